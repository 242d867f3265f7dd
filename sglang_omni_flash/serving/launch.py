"""Start, watch and stop `sgl-omni serve` for a Whisper model.

The same code serves `make serve`, the end-to-end tests and the benchmarks, so the CPU
workarounds are applied in exactly one place. On a machine with CUDA nothing is changed:
the command is sglang-omni's own `sgl-omni serve --model-path ...`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from sglang_omni_flash.errors import UserError
from sglang_omni_flash.hardware import choose_device, choose_dtype
from sglang_omni_flash.paths import build_dir
from sglang_omni_flash.serving import cpu

_CPU_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cpu.yaml"


@dataclass(frozen=True)
class ServeOptions:
    """Everything `whisper-flash serve` / `make serve` decide about one server."""

    model: str = "base"  # embedded name (base, tiny.en) or a transformers Whisper directory
    host: str = "127.0.0.1"  # loopback by default: expose deliberately, not by accident
    port: int = 8000
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CPU workarounds only without CUDA
    extra_args: tuple[str, ...] = ()  # passed through to `sgl-omni serve` untouched
    log_file: Path | None = None  # server output goes here (else: inherited stdout/stderr)
    cpu_threads: int | None = None  # torch intra-op threads on CPU (None: all cores)
    startup_timeout_s: float = 600.0
    # Whisper-Flash speculative decoding in the ASR stage (--asr.speculative whisper-flash):
    # "auto" = on when a shipped drafter fits the model (or draft_model is given), "on" = on or
    # a start-up error naming what to pass, "off" = plain sglang-omni decoding.
    speculative: Literal["auto", "on", "off"] = "off"
    draft_model: str | None = None  # drafter checkpoint directory (default: the shipped one that fits)
    # weights and activations of the ASR stage on CPU (its target and the decode worker's drafter):
    # "auto" = hardware.choose_dtype (bfloat16 on a CPU with AMX-BF16 or AVX512-BF16, else float32), or a dtype name. On CUDA
    # sglang-omni's own default stays unless a name is given.
    dtype: str = "auto"


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]
    on_cpu: bool
    model_dir: Path
    config_file: Path | None = field(default=None)
    speculative: bool = False
    dtype: str = ""  # what the stage runs in, and why ("" = sglang-omni's own default)
    drafter: Path | None = None  # the drafter the stage will load (when speculative)
    note: str = ""  # why speculation is on / off (for the CLI to print)


def speculative_args(options: ServeOptions, model_dir: Path) -> tuple[list[str], Path | None, str]:
    """The `--asr.speculative*` flags for `options`: (argv, drafter dir, reason)."""
    if any(arg.startswith("--asr.speculative") for arg in options.extra_args):
        return [], None, "speculation as given in the extra sgl-omni arguments"
    if options.speculative == "off":
        return [], None, "plain decoding (speculation off)"
    from sglang_omni_flash.integration.serve.drafter_source import resolve_drafter

    try:
        drafter = resolve_drafter(str(model_dir), options.draft_model)
    except UserError as exc:
        if options.speculative == "on" or options.draft_model is not None:
            raise
        return [], None, f"plain decoding: {exc}"
    argv = ["--asr.speculative", "whisper-flash", "--asr.speculative_draft_model_path", str(drafter)]
    return argv, drafter, f"Whisper-Flash speculative decoding, drafter {drafter}"


def cpu_config_template() -> dict:
    with open(_CPU_CONFIG, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def render_cpu_config(model_dir: Path, *, cpu_threads: int | None = None, dtype: str = "float32") -> Path:
    """configs/cpu.yaml with the model path and the stage's dtype filled in, under the build cache."""
    config = cpu_config_template()
    config["model_path"] = str(model_dir)
    config["stages"]["asr"]["engine"]["dtype"] = dtype
    if cpu_threads is not None:
        config["stages"]["asr"].setdefault("factory", {})["cpu_intra_op_threads"] = cpu_threads
    out_dir = build_dir() / "serve-configs"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"cpu-{abs(hash((str(model_dir), cpu_threads, dtype))) % 10**10}.yaml"
    path = out_dir / name
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    tmp.replace(path)
    return path


def sgl_omni_executable() -> str:
    candidate = Path(sys.executable).with_name("sgl-omni")
    if candidate.exists():
        return str(candidate)
    found = shutil.which("sgl-omni")
    if found is None:
        raise UserError("sgl-omni is not installed in this environment; run `make serve` (it installs it)")
    return found


def plan_launch(options: ServeOptions) -> LaunchPlan:
    from sglang_omni_flash.models.embedded import resolve_model

    model_dir = resolve_model(options.model)
    on_cpu = options.device == "cpu" or (options.device == "auto" and choose_device("auto") == "cpu")
    argv = [sgl_omni_executable(), "serve"]
    config_file = None
    try:
        choice = choose_dtype(options.dtype, "cpu" if on_cpu else "cuda")
    except ValueError as exc:
        raise UserError(str(exc)) from None
    dtype_note = choice.describe() if on_cpu or options.dtype != "auto" else ""
    if on_cpu:
        config_file = render_cpu_config(model_dir, cpu_threads=options.cpu_threads, dtype=choice.name)
        argv += ["--config", str(config_file)]
        env = cpu.cpu_environment(threads=options.cpu_threads)
    else:
        argv += ["--model-path", str(model_dir)]
        if options.dtype != "auto":
            argv += ["--asr.engine.dtype", choice.name]
        env = dict(os.environ)
    spec_argv, drafter, note = speculative_args(options, model_dir)
    argv += ["--host", options.host, "--port", str(options.port), *spec_argv, *options.extra_args]
    return LaunchPlan(argv=argv, env=env, on_cpu=on_cpu, model_dir=model_dir, config_file=config_file,
                      speculative=bool(spec_argv), dtype=dtype_note, drafter=drafter, note=note)


def live_group_members(pgid: int) -> list[int]:
    """PIDs of processes in group `pgid` that are still running (zombies excluded)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def _wait_group_gone(pgid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while live_group_members(pgid) and time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.2)


class Server:
    """One `sgl-omni serve` process group: start, wait until healthy, stop by PID."""

    def __init__(self, options: ServeOptions):
        self.options = options
        self.plan = plan_launch(options)
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self.options.port}"

    def start(self) -> "Server":
        out = None
        if self.options.log_file is not None:
            self.options.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.options.log_file, "ab")
            out = self._log
        # A session of its own, so stop() can end the stage workers sgl-omni spawns too.
        self.process = subprocess.Popen(
            self.plan.argv, env=self.plan.env, stdout=out, stderr=subprocess.STDOUT if out else None,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        return self

    def wait_ready(self) -> float:
        """Block until /health answers 200; returns seconds waited. Raises if the server died."""
        assert self.process is not None
        started = time.monotonic()
        deadline = started + self.options.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"sgl-omni serve exited with code {code} before becoming healthy"
                                   + (f" (log: {self.options.log_file})" if self.options.log_file else ""))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.25)  # a refused connection costs nothing; a test suite starts ~20 servers
        raise TimeoutError(f"sgl-omni serve not healthy after {self.options.startup_timeout_s:.0f} s")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGINT the whole process group, then SIGTERM, then SIGKILL; never leaves workers behind."""
        process = self.process
        if process is None:
            return
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait_s)
                # the leader is gone; make sure no stage worker of its group lingers
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            except subprocess.TimeoutExpired:
                continue
        _wait_group_gone(process.pid)
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "Server":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

"""`whisper-flash serve`: sglang-omni's Whisper server with the project's CPU handling."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from sglang_omni_flash.errors import UserError
from sglang_omni_flash.hardware import DTYPES, cpu_summary
from sglang_omni_flash.serving.launch import Server, ServeOptions


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve Whisper through SGLang-Omni's /v1/audio/transcriptions",
        description="Start `sgl-omni serve` for a Whisper model. Without a GPU the CPU workarounds "
        "(CPU engine, libcuda stub, configs/cpu.yaml) are applied; with a GPU nothing is changed. "
        "Arguments after `--` go to `sgl-omni serve` untouched.",
    )
    parser.add_argument("--model", default="base", help="base (default), tiny.en, or a transformers Whisper directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                        help="the ASR stage's weights and activations: auto (default) = on a CPU bfloat16 where it "
                        "has AMX-BF16 or AVX512-BF16, else float32; on CUDA sglang-omni's default")
    parser.add_argument("--cpu-threads", type=int, default=None, help="torch threads of the ASR stage on CPU")
    parser.add_argument("--speculative", choices=("auto", "on", "off"), default="auto",
                        help="Whisper-Flash speculative decoding: auto (default) = on when a shipped drafter "
                        "fits the model, on = required, off = plain sglang-omni decoding")
    parser.add_argument("--draft-model", default=None, help="drafter checkpoint directory (implies --speculative on)")
    parser.add_argument("sgl_args", nargs=argparse.REMAINDER, help="-- then extra `sgl-omni serve` flags")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not (0 < args.port < 65536):
        raise UserError(f"--port must be between 1 and 65535, got {args.port}")
    extra = list(args.sgl_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    options = ServeOptions(model=args.model, host=args.host, port=args.port, device=args.device,
                           extra_args=tuple(extra), cpu_threads=args.cpu_threads,
                           speculative=args.speculative, draft_model=args.draft_model, dtype=args.dtype)
    server = Server(options)
    plan = server.plan
    mode = "CPU mode (configs/cpu.yaml, libcuda stub)" if plan.on_cpu else "CUDA mode (sglang-omni defaults)"
    dtype = f", {plan.dtype}" if plan.dtype else ""
    cpu_note = f", {cpu_summary()}" if plan.on_cpu else ""
    print(f"[whisper-flash] {mode}{dtype}{cpu_note}; model: {plan.model_dir}", file=sys.stderr)
    print(f"[whisper-flash] {plan.note}", file=sys.stderr)
    print(f"[whisper-flash] $ {' '.join(plan.argv)}", file=sys.stderr)

    # Ctrl-C reaches us (the server runs in its own session); stop the group cleanly.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    server.start()
    try:
        waited = server.wait_ready()
        print(f"\n[whisper-flash] ready in {waited:.0f} s: {server.url}\n"
              f"[whisper-flash] try:  curl -s {server.url}/v1/audio/transcriptions "
              f"-F file=@speech.wav -F response_format=json\n"
              f"[whisper-flash] Ctrl-C stops the server.\n", file=sys.stderr, flush=True)
        while server.process is not None and server.process.poll() is None:
            time.sleep(0.5)
        code = server.process.returncode if server.process is not None else 0
        print(f"[whisper-flash] server exited with code {code}", file=sys.stderr)
        return code or 0
    except KeyboardInterrupt:
        print("\n[whisper-flash] stopping the server ...", file=sys.stderr)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        raise UserError(str(exc)) from None
    finally:
        server.stop()

"""`SpecOptions`: every knob of Whisper-Flash speculation, written once for both back ends.

The standalone engine (`EngineOptions.spec`), the `whisper-flash` CLI flags, the ASR stage's
`--asr.speculative_*` flags (integration/serve/config.py builds its pydantic fields from these
dataclass fields) and the decode worker all carry this one frozen object. None of the fields
changes an output token: they set what a round costs (how many rows the target verifies, whether
a round is tried at all), never which token wins.

A field left None is chosen by `resolved(device_type, dtype)` from the *target's* device and dtype,
for both back ends alike:

* fp32 on a CPU: every verified row costs (base, batch 1, AVX2: 1 row 17.5 ms, 9 rows 26.6 ms, 33
  rows 48.6 ms), so blocks are cut where the drafter doubts (0.2) and trees stay at 8 nodes;
* bf16 on a CPU with AMX-BF16: extra rows are nearly free (1 / 9 / 32 rows of the row-invariant
  kernels: docs/engine.md), so whole blocks and 16-node trees;
* bf16 on a CPU without AMX (AVX512-BF16 dot products, the auto dtype there too): whole blocks, but
  rows cost as in fp32, so 8-node trees (measured on a 2-core EPYC, base, 24 windows of 28 s:
  Whisper-Flash 1.11-1.21x greedy at batch 1 with 8 nodes, 1.04-1.11x with 16). Paths >= 2% as with
  AMX: with the fp32 CPU's 5% the pruned rounds of a busy batch were taken and lost (batch 8:
  0.94-0.96x in three of four runs; with 2%: 0.99-1.01x);
* CUDA: the paper's whole chain, no tree, no pacing, until measured there.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

MAX_TREE_NODES = 32  # fits the engine's cache slack past the decoder window (engine.SLACK)
MAX_DRAFT_TOKENS = 64

CPU_MIN_DRAFT_PROB = 0.2  # fp32 CPU: keeps ~98.6% of a round's tokens with ~37% of the verify rows
CPU_TREE_NODES = 8  # fp32 CPU: the rows of a full chain
CPU_TREE_MIN_PROB = 0.05  # paths the drafter gives >= 5%
BF16_CPU_TREE_NODES = 16  # AMX: the offline tree table: 3.59 -> 4.02 tokens per round from 8 to 16 nodes
BF16_CPU_TREE_MIN_PROB = 0.02
BF16_CPU_NO_AMX_TREE_NODES = 8  # AVX512-BF16 without AMX: verify rows cost as in fp32


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class SpecOptions:
    # candidates proposed per round (K); the drafter's own block size is the upper bound
    num_draft_tokens: int = 8
    # propose only the leading candidates the drafter gives at least this probability (>= 1 per
    # round). None: by device and dtype (0.2 on an fp32 CPU, else 0)
    min_draft_prob: float | None = None
    # greedy rounds without timestamp rules verify a draft tree of up to this many nodes (the
    # drafter's likeliest continuations sharing their prefixes, flash/tree.py) instead of one chain.
    # 0: the paper's chain. None: by device and dtype (16 on a bf16 CPU with AMX, 8 on other CPUs, 0 on CUDA)
    tree_nodes: int | None = None
    # tree nodes whose path probability under the drafter is below this are left out (>= 1 node);
    # the threshold rises with the batch (flash.pacing.batch_min_path_prob). None: by device and dtype
    tree_min_prob: float | None = None
    # the drafter's per-round linears and head on int8 weights (CPU only). None: on for an fp32 CPU.
    # (The drafter runs in the target's dtype on both back ends: a bf16 drafter streams half of
    # fp32's bytes already, and dynamic int8 would turn its activations back to fp32.)
    drafter_int8: bool | None = None
    # per step, a round only where its measured cost is paid by the running acceptance, else a
    # plain step (flash.pacing). None: on for a CPU
    pace: bool | None = None
    # a request whose round accepted nothing drafts again only after 1, 2, 4 .. this many plain steps
    # (0: it drafts at every step, as drafter evaluations want)
    max_backoff: int = 8

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            problems.append(f"num_draft_tokens must be between 1 and {MAX_DRAFT_TOKENS}, got {self.num_draft_tokens}")
        for name in ("min_draft_prob", "tree_min_prob"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                problems.append(f"{name} must be between 0 and 1, got {value}")
        if self.tree_nodes is not None and not 0 <= self.tree_nodes <= MAX_TREE_NODES:
            problems.append(f"tree_nodes must be between 0 and {MAX_TREE_NODES}, got {self.tree_nodes}")
        if self.max_backoff < 0:
            problems.append(f"max_backoff must be at least 0, got {self.max_backoff}")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def with_(self, **changes) -> "SpecOptions":
        return replace(self, **changes)

    def resolved(self, device_type: str, dtype, amx: bool | None = None) -> "SpecOptions":
        """Every None filled in for a target on `device_type` ("cpu", "cuda") in `dtype`; `amx`: the
        CPU has AMX-BF16 tiles (None: this machine's CPU is asked)."""
        cpu = device_type == "cpu"
        bf16_cpu = cpu and dtype_name(dtype) == "bfloat16"
        if bf16_cpu and amx is None:
            from sglang_omni_flash.hardware import cpu_flags

            amx = "amx_bf16" in cpu_flags()
        tree = ((BF16_CPU_TREE_NODES if amx else BF16_CPU_NO_AMX_TREE_NODES), BF16_CPU_TREE_MIN_PROB) if bf16_cpu \
            else (CPU_TREE_NODES, CPU_TREE_MIN_PROB) if cpu else (0, 0.0)
        return replace(
            self,
            min_draft_prob=(CPU_MIN_DRAFT_PROB if cpu and not bf16_cpu else 0.0) if self.min_draft_prob is None
            else self.min_draft_prob,
            tree_nodes=tree[0] if self.tree_nodes is None else self.tree_nodes,
            tree_min_prob=tree[1] if self.tree_min_prob is None else self.tree_min_prob,
            drafter_int8=(cpu and dtype_name(dtype) == "float32") if self.drafter_int8 is None else self.drafter_int8,
            pace=cpu if self.pace is None else self.pace,
        )

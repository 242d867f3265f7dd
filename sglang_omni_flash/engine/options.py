"""Every knob of the standalone engine, in one frozen dataclass passed from the CLI down."""

from __future__ import annotations

from dataclasses import dataclass, replace


# Defaults by device and dtype. They only set cost, never output. fp32 on a CPU: every verify row
# costs (base, batch 1, this project's AVX2 CPU: 1 row 17.5 ms, 9 rows 26.6 ms, 33 rows 48.6 ms;
# docs/engine.md "What a round costs"), so blocks are cut where the drafter doubts and trees stay at
# 8 nodes. bf16 on a CPU with AMX-BF16: extra rows are nearly free (1 / 9 / 32 rows = 9.4 / 11.7 /
# 14.2 ms, measured on an AMX CPU), so whole blocks and a 16-node tree (the offline tree table:
# 3.59 -> 4.02 tokens per round from 8 to 16 nodes). CUDA: the paper's whole chain until measured.

# min_draft_prob, fp32 CPU: keeps ~98.6% of a round's tokens with ~37% of the verify rows for the
# shipped base drafter on held-out data (benchmarks/draft_cut_analysis.py)
CPU_MIN_DRAFT_PROB = 0.2
CPU_TREE_NODES = 8  # fp32 CPU: the rows of a full chain (decode 1.94x -> 2.13x greedy on the test set)
CPU_TREE_MIN_PROB = 0.05  # paths the drafter gives >= 5%
AMX_TREE_NODES = 16
AMX_TREE_MIN_PROB = 0.02
MAX_TREE_NODES = 32  # fits the cache's slack past the decoder window (engine.SLACK)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cheap_rows(device_type: str, dtype) -> bool:
    """True where a verify row costs little next to the step's fixed cost: a CPU running bf16,
    which the engine chooses by itself only with AMX-BF16 (hardware.choose_dtype)."""
    return device_type == "cpu" and _dtype_name(dtype) == "bfloat16"


def default_min_draft_prob(device_type: str, dtype="float32") -> float:
    """min_draft_prob when none is given (the engine and the SGLang-Omni decode worker both use
    this): cut blocks on an fp32 CPU, whole blocks where rows are cheap and on CUDA."""
    if device_type != "cpu" or _cheap_rows(device_type, dtype):
        return 0.0
    return CPU_MIN_DRAFT_PROB


def default_tree(device_type: str, dtype="float32") -> tuple[int, float]:
    """(tree_nodes, tree_min_prob) when none are given."""
    if _cheap_rows(device_type, dtype):
        return AMX_TREE_NODES, AMX_TREE_MIN_PROB
    return (CPU_TREE_NODES, CPU_TREE_MIN_PROB) if device_type == "cpu" else (0, 0.0)


def default_drafter_int8(device_type: str, dtype="float32") -> bool:
    """drafter_int8 when none is given: int8 drafter weights on an fp32 CPU, where a drafter call
    costs the bytes it streams (13.0 -> 8.1 ms a call, for 0.4% of tau on held-out data). A bf16
    drafter streams half of fp32's bytes already and runs on the bf16 units, and dynamic int8 would
    turn its activations back to fp32, so bf16 keeps its own weights."""
    return device_type == "cpu" and _dtype_name(dtype) == "float32"


def default_pace(device_type: str) -> bool:
    """pace when none is given: on a CPU, where a verify row costs and a round can lose to plain
    steps (batch 8 in fp32: docs/engine.md); off on CUDA until measured there."""
    return device_type == "cpu"


@dataclass(frozen=True)
class EngineOptions:
    # target model: "base", "tiny.en" (embedded, converted on first use) or a transformers Whisper directory
    model: str = "base"
    # drafter directory; None = the drafter shipped for the model if any, else untrained-from-target
    drafter: str | None = None
    # True: Whisper-Flash propose/verify/advance; False: plain greedy/sampling, one token per target call
    speculative: bool = True
    # candidates proposed per round (K); the drafter's own block size when a drafter is loaded
    block_size: int = 8
    # requests decoded together as one static batch
    batch_size: int = 1
    # 0 = greedy (argmax); > 0 = fixed-temperature sampling with speculative rejection sampling
    temperature: float = 0.0
    # seed of the sampling generator (one torch.Generator per decode call)
    seed: int = 0
    # temperature fallback (engine.fallback), with temperature 0 only: a window judged too repetitive or
    # too unsure is decoded again at each of these temperatures in turn, the last attempt kept; () = off.
    # openai-whisper's ladder is engine.fallback.LADDER (0.2 .. 1.0)
    temperature_fallback: tuple[float, ...] = ()
    compression_ratio_threshold: float | None = 2.4  # retry above this gzip ratio (None: no check)
    logprob_threshold: float | None = -1.0  # retry below this average log-probability (None: no check)
    no_speech_threshold: float | None = 0.6  # silence above this <|nospeech|> probability, when also unsure
    # emit Whisper timestamp tokens (timestamp logit rules on, <|notimestamps|> left out of the prompt)
    timestamps: bool = False
    # language code ("en", "de", ...) for multilingual models; None = detect per request
    language: str | None = None
    # "transcribe" or "translate" (multilingual models only)
    task: str = "transcribe"
    # generated-token budget per request, EOS included; None = up to the 448-position decoder window
    max_new_tokens: int | None = None
    # "auto" (cuda if available, else cpu), "cpu" or "cuda"
    device: str = "auto"
    # "auto" (cuda: float16; cpu: bfloat16 where the CPU has AMX-BF16, else float32; see
    # hardware.choose_dtype), "float32", "float16" or "bfloat16"
    dtype: str = "auto"
    # CUDA only: replay prefill / draft / verify through captured CUDA graphs
    cuda_graphs: bool = True
    # torch intra-op threads on CPU; None = leave torch's default
    threads: int | None = None
    # propose only the leading candidates the drafter gives at least this probability (>= 1 per
    # round); cost only, never output. None = by device and dtype (default_min_draft_prob):
    # CPU_MIN_DRAFT_PROB on an fp32 CPU (every candidate row costs), 0 in bf16 and on CUDA
    min_draft_prob: float | None = None
    # run the drafter's per-round linears and head on int8 weights (CPU only; cost and proposals, never
    # output). None = by device and dtype: on for an fp32 CPU
    drafter_int8: bool | None = None
    # greedy rounds without timestamps verify a draft tree of up to this many nodes (the top tokens of
    # the drafter's distributions, best-first by path probability) instead of one chain; output is
    # the same, tokens per target call rise. 0 = the paper's chain. None = by device and dtype (default_tree)
    tree_nodes: int | None = None
    # tree nodes whose path probability under the drafter is below this are left out (>= 1 node)
    tree_min_prob: float | None = None
    # per step, a round only where its measured cost is paid by the running acceptance, else a
    # plain step (engine.pacing; cost only, never output). None = by device: on for CPU
    pace: bool | None = None

    def with_(self, **changes) -> "EngineOptions":
        """A copy with some fields changed (the options object itself never changes)."""
        return replace(self, **changes)

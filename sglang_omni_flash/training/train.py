"""`train_drafter(options)`: packed-anchor training of a Whisper-Flash drafter on teacher extractions.

Recipe (paper A.3, scaled by options): AdamW, peak lr 6e-4, 4% linear warm-up then cosine decay to 0,
gradient clipping 1.0, FP32 on CPU / BF16 autocast on CUDA, up to 16 anchors per utterance sampled
without replacement, loss eq. 3. Validation on held-out teacher data gives two figures: `tau`, the mean
accepted prefix + 1 at (up to 24) evenly sampled anchors per utterance, and `rollout_tau`, the tokens per
target call of greedy decoding replayed on the teacher tokens (`packing.rollout`: rounds start right
after a rejection, as in real decoding). The best checkpoint by `select` (default: rollout_tau, which
tracks real decoding where tau stopped doing so: docs/training.md, "What was tried and measured") is kept as a drafter
directory (`best/`, fp16 safetensors + config.json) beside resumable training state (`state/`).

On-policy anchors (`onpolicy` > 0): that share of each utterance's anchors is drawn from the anchors the
current drafter's own greedy rollout visits, the rest evenly from the other positions -- training where
real decoding starts its rounds. It costs one no-grad drafter pass over every anchor of the batch.

Everything random is a pure function of (seed, step): the utterance order of each epoch and the anchors
of each step, so a run resumed from a checkpoint reaches the same weights as an uninterrupted one.

CPU budget switches (defaults chosen for the shipped CPU drafters, see docs/training.md):
* `freeze_acoustic_kv`: keep the drafter's acoustic K/V projections at their initial values (Whisper's
  own cross-attention K/V of blocks 0-1), so acoustic K/V are computed once per utterance and cached.
* `draft_vocab_top`: a reduced draft vocabulary -- token ids below this bound (BPE ranks: the most
  frequent pieces), every special/timestamp token, and every token of the training labels.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_omni_flash.errors import UserError
from sglang_omni_flash.flash.checkpoint import TargetIdentity
from sglang_omni_flash.training import merge, packing
from sglang_omni_flash.training.curves import TrainingLog, plot_curve

STATE = "state"
BEST = "best"
LOG_CSV = "log.csv"
SUMMARY = "summary.json"
MERGED = "merged"
SELECT = ("rollout_tau", "tau", "worst_gain")


@dataclass(frozen=True)
class TrainOptions:
    teacher: tuple[str, ...]  # teacher extraction folders (training data)
    out: str  # output folder: state/, best/, log.csv, learning_curve.png, summary.json
    validation: tuple[str, ...] = ()  # teacher folders of held-out voices/texts (checkpoint selection)
    # teacher folders validated and logged beside them but never used to select (speakers kept apart
    # so the figures reported on them were not chosen on them)
    report: tuple[str, ...] = ()
    model: str = "base"  # the target the teacher data came from (embedding, head, initialisation)
    steps: int = 1000
    batch_size: int = 4  # utterances per update (paper: 4)
    anchors: int = 16  # anchors per utterance
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of steps
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    checkpoint_every: int = 100
    use_audio: bool = True  # --no-audio: ablation without the acoustic memory
    use_history: bool = True  # --no-history: ablation without the target's history
    freeze_acoustic_kv: bool = True
    draft_vocab_top: int = 16000  # 0 = full vocabulary
    block_size: int = 8
    onpolicy: float = 0.0  # share of anchors drawn from the current drafter's rollout (0 = all uniform)
    # validation figure that picks best/: "rollout_tau", "tau", or "worst_gain" (the smallest rollout-tau gain
    # over the warm start across validation folders: high only if real AND synthetic speech improved)
    select: str = "rollout_tau"
    # after training: interpolate best/ with the warm start at these weights of the fine-tune (merge.py)
    # and keep the one `select` prefers, alpha 1 (best/ itself) included, in merged/
    merge: tuple[float, ...] = ()
    soft_weight: float = 0.0  # share of the loss against the target's top-k distribution (tree-aware; 0 = hard only)
    init: str = ""  # warm start: a drafter directory (same target and shape) whose weights start the run
    threads: int | None = None
    device: str = "auto"

    def fixed(self) -> dict:
        """What a resumed run must agree on."""
        d = asdict(self)
        for k in ("out", "threads", "eval_every", "checkpoint_every", "device", "merge", "report"):
            d.pop(k)
        return d


def lr_at(step: int, options: TrainOptions) -> float:
    """Linear warm-up to the peak, then cosine decay to 0 (step counts from 0)."""
    warm = max(1, round(options.warmup * options.steps))
    if step < warm:
        return options.lr * (step + 1) / warm
    progress = (step - warm) / max(1, options.steps - warm)
    return options.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class Trainer:
    def __init__(self, options: TrainOptions, progress: bool = True, data=None):
        """data: (train index, train utterances, validation and report utterances by folder, training
        folders still to encode) already loaded by another Trainer of the same teacher folders (a
        recipe's ablation arms), instead of loading them again."""
        from transformers import WhisperForConditionalGeneration

        from sglang_omni_flash.flash.drafter import WhisperFlashDrafter
        from sglang_omni_flash.models.embedded import resolve_model

        if options.select not in SELECT:
            raise UserError(f"select must be one of {SELECT}, got {options.select}")
        if options.merge and not options.init:
            raise UserError("merge interpolates with the warm start: it needs init")
        if any(not 0.0 < a <= 1.0 for a in options.merge):
            raise UserError(f"merge weights must lie in (0, 1], got {options.merge}")
        self.options = options
        self.progress = progress
        if options.threads:
            torch.set_num_threads(options.threads)
        from sglang_omni_flash.hardware import choose_device

        try:
            self.device = torch.device(choose_device(options.device))
        except ValueError as exc:
            raise UserError(str(exc)) from None
        self.out = Path(options.out)
        self.out.mkdir(parents=True, exist_ok=True)

        if data is not None:
            self.train_index, self.train, self.val_sets, self.report_sets, self.unencoded = data
        else:
            # the training clips' encoder outputs are recomputed only when an update needs them (`run`):
            # resuming a run whose updates are done (to merge or evaluate) skips that (~15 min for base)
            self.unencoded: list = []
            self.train_index, self.train = self._load(options.teacher, progress, unencoded=self.unencoded)
            self.val_sets = self._load_sets(options.validation, progress)
            self.report_sets = self._load_sets(options.report, progress)
        self.val = [u for utts in self.val_sets.values() for u in utts]
        if not self.train:
            raise UserError("the teacher folders hold no usable utterance")

        model_dir = resolve_model(options.model)
        target = WhisperForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
        self.target = target.to(self.device).eval()
        for p in self.target.parameters():
            p.requires_grad_(False)
        self._check_teacher(self.train_index)

        # a warm start's source is read once: it widens the draft vocabulary and gives the weights
        source = self._load_source(options.init) if options.init else None
        draft_vocab = self._draft_vocab(source) if options.draft_vocab_top else None
        torch.manual_seed(options.seed)
        self.drafter = WhisperFlashDrafter.from_target(
            self.target,
            block_size=options.block_size,
            history_layers=tuple(self.train_index["history_layers"]),
            use_audio=options.use_audio,
            use_history=options.use_history,
            draft_vocab=draft_vocab,
        ).float().to(self.device)
        if source is not None:
            self._warm_start(source, options.init)
        # the warm start's weights (merge.py interpolates from them) and its validation by folder (the
        # baseline `worst_gain` counts from; measured at step 0, kept in the training state)
        self.start_state = {k: v.detach().cpu().clone() for k, v in self.drafter.state_dict().items()} if source else {}
        self.baseline: dict[str, float] = {}
        if options.freeze_acoustic_kv and options.use_audio:
            for layer in self.drafter.layers:
                for p in (*layer.acoustic_attn.k_proj.parameters(), *layer.acoustic_attn.v_proj.parameters()):
                    p.requires_grad_(False)
        self.index = packing.vocab_index(getattr(self.drafter, "draft_vocab", None), self.drafter.config.vocab_size)
        self.weights = packing.position_weights(options.block_size).to(self.device)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=options.lr, betas=(0.9, 0.95), weight_decay=options.weight_decay, foreach=True
        )
        self.step = 0
        self.best_tau = -math.inf
        # Keyed by the utterance's encoder-output object, not its id: ids are unique within one extraction
        # only (every packed corpus has a "packed-00000"), several teacher folders train together, and
        # folders of the same clips (with and without timestamps) share one encoder output (`_load`).
        # Each entry also holds that tensor, so the id() it is filed under cannot be reused.
        self._acoustic_cache: dict[int, tuple] = {}

    # -- data ------------------------------------------------------------------------------
    @staticmethod
    def _load(folders, progress: bool = False, unencoded: list | None = None):
        """(index, utterances) of these teacher folders, encoder outputs recomputed where the extraction
        did not keep them; with `unencoded` (a list), each folder's (index, utterances) is put there
        instead, for `encode_training_clips` to recompute later."""
        from sglang_omni_flash.training.extract import load_teacher, recompute_encoders

        index, utts, known = None, [], {}
        for folder in folders:
            idx, part = load_teacher(folder)
            if unencoded is None:
                recompute_encoders(part, idx, progress=progress, known=known)
            else:
                unencoded.append((idx, part))
            if index is not None and TargetIdentity.of_record(idx).differences(TargetIdentity.of_record(index)):
                raise UserError(f"{folder} was extracted from another target than {folders[0]}")
            index = index or idx
            utts += part
        return index, utts

    def encode_training_clips(self) -> None:
        """Recompute the training clips' encoder outputs that `_load` left for later (once: the
        utterances are shared with ablation arms, which then find them done)."""
        from sglang_omni_flash.training.extract import recompute_encoders

        known: dict = {}
        while self.unencoded:
            idx, part = self.unencoded[0]
            recompute_encoders(part, idx, progress=self.progress, known=known)
            self.unencoded.pop(0)

    def _check_teacher(self, index: dict) -> None:
        if TargetIdentity.of_record(index).differences(TargetIdentity.of_target(self.target)):
            raise UserError(
                f"the teacher data was extracted from another model ({index['model']}) than --model {self.options.model}"
            )

    def _draft_vocab(self, source=None) -> torch.Tensor:
        cfg = self.target.config
        eos = self.train_index["eos"]
        ids = set(range(min(self.options.draft_vocab_top, cfg.vocab_size)))
        ids |= set(range(eos, cfg.vocab_size))  # EOS, special and timestamp tokens
        for utt in self.train:
            ids |= set(utt.tokens[utt.prompt_len :].tolist())
        if source is not None and getattr(source, "draft_vocab", None) is not None:
            # A warm start keeps every id its source could propose: fine-tuning on a new corpus must
            # not silently drop the tokens only the earlier corpora contained.
            ids |= set(source.draft_vocab.tolist())
        return torch.tensor(sorted(ids), dtype=torch.long)

    def _load_source(self, path: str):
        from sglang_omni_flash.flash.checkpoint import load_drafter

        return load_drafter(path, self.target, device=self.device, dtype=torch.float32)

    def _warm_start(self, source, path: str) -> None:
        """Start from a trained drafter's weights (fine-tuning on new data, or a longer second run).

        Only the draft vocabulary is this run's own: it is an index into the shared target head, not a
        weight, so new training labels may widen it. Everything else must match this run's shape.
        """
        mine, theirs = self.drafter.config, source.config
        for name in ("d_model", "n_layers", "block_size", "history_layers", "use_audio", "use_history"):
            if getattr(mine, name) != getattr(theirs, name):
                raise UserError(
                    f"--init {path}: its {name} is {getattr(theirs, name)}, this run needs {getattr(mine, name)}"
                )
        state = {k: v for k, v in source.state_dict().items() if k != "draft_vocab"}
        missing, unexpected = self.drafter.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if k != "draft_vocab"]:
            raise UserError(f"--init {path}: weights do not fit ({missing or unexpected})")

    def _acoustic(self, utts):
        """Per layer (k, v) [U, H, T, hd] for these utterances (cached when the projections are frozen)."""
        d = self.drafter
        if not d.config.use_audio:
            return None
        if not self.options.freeze_acoustic_kv:
            enc = torch.stack([u.encoder for u in utts]).to(self.device, torch.float32)
            return d.acoustic_kv(enc)
        per_utt = []
        for u in utts:
            entry = self._acoustic_cache.get(id(u.encoder))
            if entry is None:
                with torch.no_grad():
                    kv = [(k.half(), v.half()) for k, v in d.acoustic_kv(u.encoder[None].to(self.device, torch.float32))]
                entry = self._acoustic_cache[id(u.encoder)] = (u.encoder, kv)
            kv = entry[1]
            per_utt.append(kv)
        return [
            (torch.cat([p[i][0] for p in per_utt]).float(), torch.cat([p[i][1] for p in per_utt]).float())
            for i in range(d.config.n_layers)
        ]

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.options.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.train), generator=g).tolist()

    def batch_for(self, step: int):
        """The utterances and anchors of update `step` (a pure function of seed and step)."""
        self.encode_training_clips()  # a no-op once done
        n, bs = len(self.train), min(self.options.batch_size, len(self.train))
        per_epoch = max(1, n // bs)
        epoch, k = divmod(step, per_epoch)
        order = self._order(epoch)[k * bs : (k + 1) * bs]
        utts = [self.train[i] for i in order]
        g = torch.Generator().manual_seed(self.options.seed * 7_919 + step)
        if self.options.onpolicy > 0:  # the drafter's state at `step` is itself a function of seed and step
            share, n = self.options.onpolicy, self.options.anchors
            anchors = [packing.mix_anchors(self.rollout_of(u), u.prompt_len, u.tokens.numel(), n, share, g) for u in utts]
        else:
            anchors = [packing.sample_anchors(u.prompt_len, u.tokens.numel(), self.options.anchors, g) for u in utts]
        return utts, anchors

    @torch.no_grad()
    def prefix_everywhere(self, utt) -> torch.Tensor:
        """The current drafter's greedy accepted-prefix length at every anchor of `utt` (teacher-forced)."""
        was_training = self.drafter.training
        self.drafter.eval()
        anchors = [list(range(utt.prompt_len, utt.tokens.numel() - 1))]
        batch = _to(packing.pack([utt], anchors, self.options.block_size, self.drafter.config.use_history), self.device)
        states = packing.packed_states(self.drafter, batch, self._acoustic([utt]))[0]  # [A, K, d]
        logits = self.drafter.logits(states, full=False)
        prefix = packing.accepted_prefix(logits, packing.map_labels(batch.labels[0], self.index)).cpu()
        self.drafter.train(was_training)
        return prefix

    def rollout_of(self, utt) -> list[int]:
        """The anchors greedy Whisper-Flash decoding with the current drafter starts its rounds from."""
        return packing.rollout(self.prefix_everywhere(utt), utt.prompt_len, utt.tokens.numel())

    # -- one update --------------------------------------------------------------------------
    def train_step(self) -> float:
        opts = self.options
        utts, anchors = self.batch_for(self.step)
        self.drafter.train()
        batch = packing.pack(utts, anchors, opts.block_size, self.drafter.config.use_history)
        batch = _to(batch, self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, opts)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext()
        with autocast:
            acoustic = self._acoustic(utts)
            loss, _, _, _ = packing.packed_loss(self.drafter, batch, acoustic, self.weights, self.index, opts.soft_weight)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), opts.clip)
        self.optimizer.step()
        self.step += 1
        return float(loss.detach())

    def _load_sets(self, folders, progress: bool) -> dict[str, list]:
        """Teacher folders by name, each validated and reported on its own (real / synthetic)."""
        sets = {}
        for folder in folders:
            name = Path(folder).name
            while name in sets:
                name += "+"
            sets[name] = self._load([folder], progress)[1]
        return sets

    @torch.no_grad()
    def validate(self, utts=None, max_anchors: int = 24) -> dict:
        """Greedy accepted-prefix statistics over (up to max_anchors per utterance) anchors of held-out data:
        over all of it, and rollout tau / first per validation folder under "sets" (when utts is not given)."""
        sets = {"given": utts} if utts is not None else self.val_sets
        if not any(sets.values()):
            return {}
        self.drafter.eval()
        g = torch.Generator().manual_seed(12345)
        prefixes, losses, by_pos, n_lab, top4 = [], [], torch.zeros(self.options.block_size), 0, []
        per_set, totals = {}, [0, 0, 0, 0]  # tokens, rounds, first, utterances
        for name, part_utts in sets.items():
            for start in range(0, len(part_utts), 4):
                part = part_utts[start : start + 4]
                anchors = [packing.sample_anchors(u.prompt_len, u.tokens.numel(), max_anchors, g) for u in part]
                batch = _to(packing.pack(part, anchors, self.options.block_size, self.drafter.config.use_history),
                            self.device)
                loss, n, logits, labels = packing.packed_loss(self.drafter, batch, self._acoustic(part), self.weights,
                                                              self.index)
                prefix = packing.accepted_prefix(logits, labels)
                prefixes.append(prefix.cpu())
                top4.append((logits[:, 0].topk(4, dim=-1).indices == labels[:, :1]).any(-1).cpu())
                losses.append(float(loss) * int(n))
                n_lab += int(n)
                for j in range(self.options.block_size):
                    by_pos[j] += float((prefix > j).float().sum())
            tokens, rounds, first = self._replay(part_utts)
            per_set[name] = _rollout_figures(tokens, rounds, first, len(part_utts))
            for i, v in enumerate((tokens, rounds, first, len(part_utts))):
                totals[i] += v
        prefix = torch.cat(prefixes)
        tokens, rounds, first, n_utts = totals
        metrics = {
            "tau": packing.expected_tau(prefix),
            "first": float((prefix > 0).float().mean()),
            # a tree's worth: how often the first label is among the drafter's four best first tokens
            "first_top4": float(torch.cat(top4).float().mean()),
            "loss": sum(losses) / max(1, n_lab),
            "accept_by_position": (by_pos / max(1, prefix.numel())).tolist(),
            "blocks": int(prefix.numel()),
            "rollout_tau": packing.rollout_tau(tokens, rounds, n_utts),
            "rollout_first": first / max(1, rounds),
            "rollout_rounds": rounds,
        }
        if utts is None:
            metrics["sets"] = per_set
            metrics["worst_gain"] = merge.worst_gain(_set_taus(metrics), self.baseline)
            # logged, never compared by `select`
            metrics["report"] = {name: _rollout_figures(*self._replay(part_utts), len(part_utts))
                                 for name, part_utts in self.report_sets.items()}
        return metrics

    def _replay(self, utts) -> tuple[int, int, int]:
        """Greedy Whisper-Flash decoding replayed on the teacher tokens: tokens, rounds, rounds whose first
        candidate was accepted."""
        tokens = rounds = first = 0
        for u in utts:
            everywhere = self.prefix_everywhere(u)
            visited = packing.rollout(everywhere, u.prompt_len, u.tokens.numel())
            tokens += u.tokens.numel() - u.prompt_len
            rounds += len(visited)
            first += sum(int(everywhere[t - u.prompt_len] > 0) for t in visited)
        return tokens, rounds, first

    # -- checkpoints -------------------------------------------------------------------------
    def save_state(self) -> None:
        state_dir = self.out / STATE
        state_dir.mkdir(exist_ok=True)
        tmp = state_dir / "train.pt.tmp"
        torch.save(
            {
                "step": self.step,
                "best_tau": self.best_tau,
                "baseline": self.baseline,
                "drafter": self.drafter.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "options": self.options.fixed(),
            },
            tmp,
        )
        os.replace(tmp, state_dir / "train.pt")

    def try_resume(self) -> bool:
        path = self.out / STATE / "train.pt"
        if not path.is_file():
            return False
        saved = torch.load(path, map_location=self.device, weights_only=False)
        if saved["options"] != self.options.fixed():
            changed = sorted(k for k in saved["options"] if saved["options"][k] != self.options.fixed().get(k))
            raise UserError(f"{self.out} holds a run with other settings ({', '.join(changed)}): use another --out")
        self.drafter.load_state_dict(saved["drafter"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.step = saved["step"]
        self.best_tau = saved["best_tau"]
        self.baseline = saved.get("baseline", {})
        return True

    def save_best(self, metrics: dict, folder: str = BEST) -> None:
        from sglang_omni_flash.flash.checkpoint import save_drafter

        tmp = self.out / (folder + ".tmp")
        save_drafter(self.drafter, tmp)
        (tmp / "metrics.json").write_text(json.dumps(dict(metrics, step=self.step), indent=1) + "\n")
        final = self.out / folder
        if final.exists():
            import shutil

            shutil.rmtree(final)
        os.replace(tmp, final)

    def merge_with_start(self) -> dict:
        """Interpolate best/ with the warm start at each `merge` weight, validate each, and keep the one
        `select` prefers (best/ itself, weight 1, included) in merged/. Done once: a finished merge is
        read back, since resuming a finished run must not redo it."""
        from sglang_omni_flash.flash.checkpoint import load_drafter

        done = self.out / MERGED / "metrics.json"
        weights = sorted(set(self.options.merge) | {1.0})
        if done.is_file():
            record = json.loads(done.read_text())
            if record.get("weights") == weights:
                return record["merge"]
        tuned = load_drafter(self.out / BEST, self.target, device=self.device, dtype=torch.float32).state_dict()
        tried, best = {}, None
        for alpha in tqdm(weights, desc="merge", unit="weight", file=sys.stderr, disable=not self.progress):
            state = merge.interpolate(self.start_state, tuned, alpha)
            self.drafter.load_state_dict(state)
            metrics = self.validate()
            tried[f"{alpha:g}"] = {"select": metrics[self.options.select], "rollout_tau": metrics["rollout_tau"],
                                   "sets": _set_taus(metrics)}
            # the select figure, ties broken by the mean gain over the warm start across the sets
            rank = (metrics[self.options.select], merge.mean_gain(_set_taus(metrics), self.baseline))
            if best is None or rank > best[3]:
                best = (alpha, metrics, state, rank)
        alpha, metrics, state, _ = best
        self.drafter.load_state_dict(state)
        record = {"alpha": alpha, "select": self.options.select, "weights": weights, "merge": tried,
                  "baseline": self.baseline}
        self.save_best(dict(metrics, **record), folder=MERGED)
        return tried

    # -- the loop ----------------------------------------------------------------------------
    def run(self, stop_after: int | None = None) -> dict:
        """Train to options.steps (or `stop_after` more updates: tests interrupt with it)."""
        opts = self.options
        resumed = self.try_resume()
        log = TrainingLog(self.out / LOG_CSV, fresh=not resumed)
        end = opts.steps if stop_after is None else min(opts.steps, self.step + stop_after)
        bar = tqdm(total=opts.steps, initial=self.step, desc="train", unit="step", file=sys.stderr,
                   disable=not self.progress, dynamic_ncols=True)
        t0 = time.perf_counter()
        running = None
        last_val: dict = {}
        if self.val and self.start_state and self.step == 0 and not self.baseline:
            # the warm start's own figures per folder: what `worst_gain` and the merge count from
            start_val = self.validate()
            self.baseline = _set_taus(start_val)
            log.write({"step": 0} | _val_row(start_val))
        with bar:
            while self.step < end:
                loss = self.train_step()
                running = loss if running is None else 0.9 * running + 0.1 * loss
                row = {"step": self.step, "loss": loss, "lr": lr_at(self.step - 1, opts), "seconds": time.perf_counter() - t0}
                at_end = self.step == opts.steps
                if self.val and (self.step % opts.eval_every == 0 or at_end):
                    last_val = self.validate()
                    row |= _val_row(last_val)
                    if last_val[opts.select] > self.best_tau:
                        self.best_tau = last_val[opts.select]
                        self.save_best(last_val)
                log.write(row)
                if self.step % opts.checkpoint_every == 0 or at_end:
                    if not self.val and at_end:
                        self.save_best({})
                    self.save_state()
                bar.set_postfix(loss=f"{running:.3f}", val_tau=f"{last_val.get('tau', math.nan):.2f}",
                                rollout_tau=f"{last_val.get('rollout_tau', math.nan):.2f}")
                bar.update(1)
        summary = {"step": self.step, "select": opts.select, "best_val": self.best_tau, "last_val": last_val,
                   "baseline": self.baseline, "result": str(self.out / BEST),
                   "train_utterances": len(self.train), "val_utterances": len(self.val),
                   "trainable_parameters": sum(p.numel() for p in self.drafter.parameters() if p.requires_grad),
                   "draft_vocab_size": self.drafter.config.draft_vocab_size}
        if opts.merge and self.step == opts.steps and self.val:
            summary["merge"] = self.merge_with_start()
            summary["result"] = str(self.out / MERGED)
        (self.out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
        plot_curve(self.out / LOG_CSV, self.out / "learning_curve.png")
        return summary


def _rollout_figures(tokens: int, rounds: int, first: int, utterances: int) -> dict:
    """One validation folder's replayed decoding (`Trainer._replay`) as rollout tau and first."""
    return {"rollout_tau": packing.rollout_tau(tokens, rounds, utterances), "rollout_first": first / max(1, rounds)}


def _set_taus(metrics: dict) -> dict[str, float]:
    """Rollout tau by validation folder, from validate()'s "sets"."""
    return {name: v["rollout_tau"] for name, v in metrics.get("sets", {}).items()}


def _val_row(metrics: dict) -> dict:
    """The log.csv columns of one validation."""
    return {"val_tau": metrics["tau"], "val_first": metrics["first"], "val_loss": metrics["loss"],
            "val_rollout_tau": metrics["rollout_tau"], "val_first_top4": metrics["first_top4"],
            "val_rollout_by_set": " ".join(f"{name}:{tau:.3f}" for name, tau in _set_taus(metrics).items()),
            "report_rollout_by_set": " ".join(f"{name}:{v['rollout_tau']:.3f}"
                                              for name, v in metrics.get("report", {}).items())}


def _to(batch: packing.PackedBatch, device) -> packing.PackedBatch:
    for name in ("block_tokens", "block_pos", "is_anchor_row", "labels", "history", "history_pos", "attn_mask"):
        value = getattr(batch, name)
        if value is not None:
            if name == "history":
                value = value.float()
            setattr(batch, name, value.to(device))
    return batch

"""A training run's log (log.csv, appended as it runs, kept across resumes) and its learning curve."""

from __future__ import annotations

import csv
import math
from pathlib import Path


class TrainingLog:
    """log.csv of a training run: one row per update and per validation (appended as it runs)."""

    FIELDS = ("step", "loss", "lr", "seconds", "val_tau", "val_first", "val_loss", "val_rollout_tau", "val_first_top4",
              "val_rollout_by_set", "report_rollout_by_set")

    def __init__(self, path: Path, fresh: bool):
        self.path = path
        if fresh or not path.is_file():
            with open(path, "w", newline="") as f:
                csv.writer(f).writerow(self.FIELDS)

    def write(self, row: dict) -> None:
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([row.get(k, "") for k in self.FIELDS])


def plot_curve(csv_path: Path, png_path: Path) -> None:
    """Training loss and validation acceptance against step (matplotlib, headless)."""
    from sglang_omni_flash.errors import require_extra

    matplotlib = require_extra("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses, vsteps, taus, rollout = [], [], [], [], []
    with open(csv_path, newline="") as f:
        for row in csv.DictReader(f):
            if row["loss"]:  # the step-0 row of a warm start holds validation only
                steps.append(int(row["step"]))
                losses.append(float(row["loss"]))
            if row.get("val_tau"):
                vsteps.append(int(row["step"]))
                taus.append(float(row["val_tau"]))
                rollout.append(float(row["val_rollout_tau"]) if row.get("val_rollout_tau") else math.nan)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, lw=0.8, color="tab:blue", label="train loss (eq. 3)")
    ax.set_xlabel("update")
    ax.set_ylabel("loss", color="tab:blue")
    if taus:
        ax2 = ax.twinx()
        ax2.plot(vsteps, taus, "o-", color="tab:red", label="validation tau (even anchors)")
        if not all(math.isnan(r) for r in rollout):
            ax2.plot(vsteps, rollout, "s--", color="tab:purple", label="validation rollout tau")
        ax2.set_ylabel("validation tau (tokens / target call)", color="tab:red")
        ax2.legend(loc="lower right", fontsize=8)
    ax.set_title("Whisper-Flash drafter training")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)

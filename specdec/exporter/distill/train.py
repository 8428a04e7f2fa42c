"""Training the draft head on the target's features (PyTorch), under a time or step budget.

Loss per pair (f_j, t_{j+1}) (EAGLE's): SmoothL1 between the head's feature and the
target's f_{j+1}, plus 0.5 x cross-entropy against the target's own distribution over the
subset at j+1; the input feature gets uniform noise (+-0.1).
One unrolled pass (HASS-style) feeds the head its own predicted features, as it will be
fed from the second draft position on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch
from torch import nn

from specdec.exporter.distill.data import Example, generator_dtype
from specdec.exporter.distill.draft_model import DraftHead

MAX_WINDOW = 256  # positions per training sequence (longer answers are cut at a random offset)


@dataclass
class TrainSettings:
    """How the head is trained; every field is recorded in the manifest."""

    batch_size: int = 8
    # lr, ce_weight and schedule from an A/B at equal steps on one data set (docs/DISTILL.md, "Why these defaults"):
    # 0.463 against the issue probe's recipe's 0.429 (lr 1e-3, ce 0.1, constant) at 450 steps.
    lr: float = 2e-3
    weight_decay: float = 0.0
    ce_weight: float = 0.5
    noise: float = 0.1  # uniform +-noise on input features
    unroll_weight: float = 0.5  # loss weight of the pass fed with the head's own features (0: off)
    warmup_steps: int = 20
    # "cosine": after warmup the rate falls to lr * final_lr_share at the planned last step (see
    # learning_rate); "constant" keeps it at lr.
    schedule: str = "cosine"
    final_lr_share: float = 0.1
    eval_every_seconds: float = 30.0
    # bfloat16 autocast (fp32 master weights): 3-4x the positions per second of fp32 on a bf16 CPU
    # (docs/DISTILL.md); "auto" resolves as data.generator_dtype does, and the manifest records the result.
    compute_dtype: str = "auto"


@dataclass
class TrainState:
    """Where training stands (saved in the checkpoint, for --resume)."""

    step: int = 0
    seconds: float = 0.0
    tokens_seen: int = 0
    curve: list[dict] = field(default_factory=list)  # held-out acceptance over training
    planned_steps: int | None = None  # the step the current run's schedule ends at (None: not planned)
    plan_history: list[list[int]] = field(default_factory=list)  # [step, planned last step] at each (re)plan


PLAN_AFTER_STEPS = 30  # steps timed before a deadline-only run plans its last step (warmup runs meanwhile)
PLAN_MARGIN = 0.95  # of the steps the measured rate fits in the time left: the rate wanders, the deadline does not
# A deadline run re-plans every eval_every_seconds where the box's speed has moved its last step by more
# than REPLAN_CHANGE (its first 30 steps once ran at 0.6x the later rate): earlier at any point (else the
# deadline cuts the cosine short), later only until it is REPLAN_UNTIL into its cosine.
REPLAN_UNTIL = 0.5
REPLAN_CHANGE = 0.02


def planned_steps(step: int, steps_done: int, seconds_done: float, seconds_left: float) -> int:
    """Return the last step of a run now at `step` that took `seconds_done` for `steps_done` steps and has
    `seconds_left`: as many more as the measured rate fits in PLAN_MARGIN of the time left."""
    rate = steps_done / max(seconds_done, 1e-9)
    return step + max(1, int(PLAN_MARGIN * rate * max(seconds_left, 0.0)))


def learning_rate(settings: TrainSettings, step: int, first: int, last: int | None) -> float:
    """Return the rate for `step` of a run planned from step `first` to `last` (None: no plan, constant).

    Linear warmup over the first warmup_steps of training (a resumed run does not warm up again),
    then constant or a cosine down to lr * final_lr_share at `last`, starting PLAN_AFTER_STEPS after
    `first` (or at the warmup's end, if later): a run under a deadline plans `last` only then, and
    one given its steps follows the same rates.
    """
    warm = min(1.0, (step + 1) / settings.warmup_steps)
    if settings.schedule == "constant" or last is None:
        return settings.lr * warm
    progress = _schedule_progress(settings, step, first, last)
    share = settings.final_lr_share + (1 - settings.final_lr_share) * 0.5 * (1 + np.cos(np.pi * progress))
    return settings.lr * warm * share


def _schedule_progress(settings: TrainSettings, step: int, first: int, last: int) -> float:
    """Return how far `step` is along the cosine of a run planned from step `first` to `last`: 0 to 1."""
    start = max(first + PLAN_AFTER_STEPS, settings.warmup_steps)
    return 0.0 if last <= start else min(1.0, max(0.0, (step - start) / (last - start)))


def _batch(examples: list[Example], picks: list[int], rng: np.random.Generator, device) -> dict[str, torch.Tensor]:
    """Return padded tensors for the pairs of the picked examples (one window each)."""
    windows = []
    for i in picks:
        ex = examples[i]
        start = int(rng.integers(0, len(ex.ids) - MAX_WINDOW + 1)) if len(ex.ids) > MAX_WINDOW else 0
        windows.append((ex, start, min(len(ex.ids), start + MAX_WINDOW)))
    width = max(b - a for _, a, b in windows) - 1  # pairs per window
    hidden_size = examples[0].features.shape[1]
    out = {"hidden": np.zeros((len(picks), width, hidden_size), np.float32),
           "target": np.zeros((len(picks), width, hidden_size), np.float32),
           "ids": np.zeros((len(picks), width), np.int64), "pos": np.zeros((len(picks), width), np.int64),
           "greedy": np.zeros((len(picks), width), np.int64), "mask": np.zeros((len(picks), width), np.float32),
           "answer": np.zeros((len(picks), width), np.float32)}
    if examples[0].layer_features is not None:  # the head's input: the feature, then the extra layers'
        out["hidden"] = np.zeros((len(picks), width, hidden_size + examples[0].layer_features.shape[1]), np.float32)
    for row, (ex, a, b) in enumerate(windows):
        n = b - a - 1
        out["hidden"][row, :n, :hidden_size] = ex.features[a:b - 1]
        if ex.layer_features is not None:
            out["hidden"][row, :n, hidden_size:] = ex.layer_features[a:b - 1]
        out["target"][row, :n] = ex.features[a + 1:b]
        out["ids"][row, :n] = ex.ids[a + 1:b]
        out["pos"][row, :n] = np.arange(a, b - 1)
        out["greedy"][row, :n] = ex.greedy_next[a + 1:b]
        out["mask"][row, :n] = 1.0
        out["answer"][row, :n] = np.arange(a + 1, b) >= ex.answer_start
    return {k: torch.from_numpy(v).to(device) for k, v in out.items()}


def _empty_past(head: DraftHead, batch: int, device) -> torch.Tensor:
    c = head.config
    return torch.zeros(batch, c.num_kv_heads, 0, c.head_dim, device=device)


def self_fed(inputs: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
    """Return the input of a pass fed the head's own features: position j reads the guess made at j-1.

    Position 0 keeps the target's input; the extra layers' part is 0 elsewhere, as at run time.
    """
    guessed = nn.functional.pad(feature[:, :-1], (0, inputs.shape[-1] - feature.shape[-1]))
    return torch.cat([inputs[:, :1], guessed], dim=1)


def _losses(head: DraftHead, b: dict[str, torch.Tensor], settings: TrainSettings, noise: bool) -> tuple:
    past = _empty_past(head, b["ids"].shape[0], b["ids"].device)
    inputs = b["hidden"]
    if noise and settings.noise:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * settings.noise
    logits, feature, _, _ = head(inputs, b["ids"], b["pos"], past, past)
    mask = b["mask"]
    with torch.no_grad():
        target_probs = torch.softmax(head.lm_head(b["target"]), dim=-1)

    def loss_of(logits, feature):
        feat = nn.functional.smooth_l1_loss(feature, b["target"], reduction="none").mean(-1)
        ce = -(target_probs * torch.log_softmax(logits, dim=-1)).sum(-1)
        return ((feat + settings.ce_weight * ce) * mask).sum() / mask.sum()

    loss = loss_of(logits, feature)
    if settings.unroll_weight:
        # Position j now reads the head's own guess of f_j (made at j-1), as a second draft step does.
        logits2, feature2, _, _ = head(self_fed(inputs, feature), b["ids"], b["pos"], past, past)
        loss = loss + settings.unroll_weight * loss_of(logits2, feature2)
    return loss, logits


def heldout_acceptance(head: DraftHead, examples: list[Example], device) -> dict[str, float]:
    """Return greedy agreement on held-out answers, teacher-forced: the head's argmax vs the target's.

    "first": the first draft position (fed the target's feature); "second": fed its own
    feature (an estimate of later positions); "subset_coverage": the share of the target's
    choices the subset can propose at all.
    """
    head.eval()
    hits = [0, 0]
    total = 0
    covered = 0
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for first in range(0, len(examples), 8):
            b = _batch(examples, list(range(first, min(first + 8, len(examples)))), rng, device)
            past = _empty_past(head, b["ids"].shape[0], device)
            logits, feature, _, _ = head(b["hidden"], b["ids"], b["pos"], past, past)
            logits2, _, _, _ = head(self_fed(b["hidden"], feature), b["ids"], b["pos"], past, past)
            weight = b["mask"] * b["answer"]
            for index, lg in enumerate((logits, logits2)):
                hits[index] += float(((head.subset_ids[lg.argmax(-1)] == b["greedy"]).float() * weight).sum())
            covered += float((head.subset_index[b["greedy"]] < head.config.subset_size).float().mul(weight).sum())
            total += float(weight.sum())
    head.train()
    total = max(total, 1.0)
    return {"first": hits[0] / total, "second": hits[1] / total, "subset_coverage": covered / total,
            "positions": int(total)}


def resolved_settings(settings: TrainSettings, device: str) -> TrainSettings:
    """Return the settings with compute_dtype "auto" replaced by what it means on `device`."""
    dtype = generator_dtype(settings.compute_dtype, device)
    return replace(settings, compute_dtype="bfloat16" if dtype == torch.bfloat16 else "float32")


def train_head(head: DraftHead, examples: list[Example], heldout: list[Example], settings: TrainSettings,
               state: TrainState, seed: int, deadline: float | None, max_steps: int | None,
               optimizer_state: dict | None = None,
               progress: Callable[[TrainState, dict | None], None] | None = None) -> tuple[TrainState, dict]:
    """Train until `deadline` (time.monotonic()) or `max_steps` total steps; return (state, optimizer state).

    Under a deadline alone, the run's last step is planned from the step rate of its first
    PLAN_AFTER_STEPS (state.planned_steps), so the learning rate can decay towards it, and
    re-planned from the rate of each eval interval since (later only while the cosine is in its
    first half, earlier at any point; state.plan_history); a run given `max_steps` follows one
    plan, so one that never re-planned is repeated exactly by as many `max_steps`. Deterministic
    for a seed and a step count (the batch order is drawn from the seed and the step number, so
    a resumed run draws what an uninterrupted one would have; its schedule restarts from where
    it resumes).
    """
    device = next(head.parameters()).device
    bf16 = resolved_settings(settings, device.type).compute_dtype == "bfloat16"
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    if optimizer_state:
        optimizer.load_state_dict(optimizer_state)
    head.train()
    last_eval = last_plan = began = time.monotonic()
    first_step = state.step
    state.planned_steps, state.plan_history = max_steps, []
    plan_step, plan_time = first_step, began
    while ((state.planned_steps is None or state.step < state.planned_steps)
           and (deadline is None or time.monotonic() < deadline)):
        now = time.monotonic()
        if state.planned_steps is None and deadline is not None and state.step - first_step == PLAN_AFTER_STEPS:
            state.planned_steps = planned_steps(state.step, state.step - first_step, now - began, deadline - now)
            state.plan_history.append([state.step, state.planned_steps])
            plan_step, plan_time, last_plan = state.step, now, now
        elif max_steps is None and state.plan_history and now - last_plan >= settings.eval_every_seconds:
            last_plan = now
            # The rate of the last interval: a run that slows late must still end its cosine by the deadline.
            replanned = planned_steps(state.step, state.step - plan_step, now - plan_time, deadline - now)
            plan_step, plan_time = state.step, now
            early = _schedule_progress(settings, state.step, first_step, state.planned_steps) < REPLAN_UNTIL
            if (abs(replanned - state.planned_steps) > REPLAN_CHANGE * state.planned_steps
                    and (replanned < state.planned_steps or early)):
                state.planned_steps = replanned
                state.plan_history.append([state.step, replanned])
        started = time.monotonic()
        rng = np.random.default_rng([seed, state.step])
        torch.manual_seed(seed * 1_000_003 + state.step)
        picks = rng.integers(0, len(examples), settings.batch_size).tolist()
        batch = _batch(examples, picks, rng, device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(settings, state.step, first_step, state.planned_steps)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, _ = _losses(head, batch, settings, noise=True)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        state.step += 1
        state.tokens_seen += int(batch["mask"].sum())
        state.seconds += time.monotonic() - started
        if progress and time.monotonic() - last_eval >= settings.eval_every_seconds:
            last_eval = time.monotonic()
            acceptance = heldout_acceptance(head, heldout, device)
            state.curve.append({"step": state.step, "train_minutes": round(state.seconds / 60, 3),
                                "tokens": state.tokens_seen, "loss": round(float(loss.detach()), 4),
                                **{k: round(v, 4) if isinstance(v, float) else v for k, v in acceptance.items()}})
            progress(state, state.curve[-1])
        elif progress and state.step % 10 == 0:
            progress(state, None)
    return state, optimizer.state_dict()

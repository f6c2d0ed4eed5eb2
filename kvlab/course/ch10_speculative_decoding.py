"""Chapter 10, speculative decoding and cache rollback: the figures (the cost of a pass over t tokens,
acceptance against k, the expected speed-up against the measured one), the speculation explorer
(a drafter's guesses, the target's choices, the first rejection and the cache cropped back, step by
step) and the exercise checkers. The decoding itself is kvlab.speculative's; this module only
records, draws and checks."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import matplotlib.pyplot as plt

from ..cache import DynamicKVCache
from ..speculative import expected_speedup, expected_tokens_per_step
from .style import (
    CACHED_FACE,
    NEW_FACE,
    PROMPT_FACE,
    Verdict,
    close,
    explorer_plot,
    new_figure,
    numeric,
    report,
    shown,
)

ACCEPT_FACE, REJECT_FACE, UNJUDGED_FACE = "#8FD19E", "#F08080", "#F4F4F4"

# ---- figures --------------------------------------------------------------------------------------


def plot_pass_cost(fed: list[int], measured: dict[str, list[float]], roofline: dict[str, list[float]]):
    """Time of one forward pass over t tokens after a cache, in units of a one-token decode step:
    measured on this machine (solid) and the roofline's floor on a GPU (dashed). Returns the Figure."""
    fig, ax = new_figure(7.0, 3.8)
    for name, ratios in measured.items():
        ax.plot(fed, ratios, "o-", label=f"{name}, measured here")
    for name, ratios in roofline.items():
        ax.plot(fed, ratios, "--", lw=2, label=f"{name}, roofline floor")
    ax.plot(fed, fed, ":", color="grey", label="t separate steps")
    ax.set_xlabel("tokens fed in one pass, t (1 = a decode step; k + 1 = a verify pass)")
    ax.set_ylabel("time ÷ one decode step")
    ax.set_title("Verifying k guesses costs one pass, not k steps", fontsize=10)
    ax.set_ylim(0, max(fed) + 0.5)
    ax.legend(fontsize=8)
    return fig


def plot_acceptance(ks: list[int], alphas: dict[str, list[float]], per_pass: dict[str, list[float]]):
    """Per-guess acceptance α and tokens a verify pass yields, against k, one line per drafter (the
    formula's tokens per pass for the measured α dotted). Returns the Figure."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    for (name, a), t in zip(alphas.items(), per_pass.values(), strict=True):
        (line,) = left.plot(ks, a, "o-", label=name)
        right.plot(ks, t, "o-", color=line.get_color(), label=name)
        right.plot(ks, [expected_tokens_per_step(x, k) for x, k in zip(a, ks, strict=True)], ":",
                   color=line.get_color())
    right.plot(ks, [k + 1 for k in ks], "--", color="grey", label="k + 1 (every guess right)")
    left.set(xlabel="guesses a step, k", ylabel="α (a guess accepted, given the ones before)", ylim=(0, 1.05))
    right.set(xlabel="guesses a step, k", ylabel="tokens per verify pass")
    left.set_title("Acceptance hardly depends on k", fontsize=10)
    right.set_title("Tokens per pass: measured (solid), formula from α (dotted)", fontsize=10)
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def plot_expected_speedup(k: int, costs: dict[str, float], measured: dict[str, tuple[float, float, float]],
                          verify_cost: float = 1.0):
    """Leviathan et al.'s expected speed-up against α for k guesses a step, one curve per draft cost
    c (in target steps), the verify pass costing `verify_cost` steps; `measured` maps a label to
    (α, c, measured speed-up), drawn as a point on its own curve's colour. Returns the Figure."""
    import numpy as np

    fig, ax = new_figure(7.0, 3.8)
    alpha = np.linspace(0, 1, 101)
    colors = {}
    for label, c in costs.items():
        (line,) = ax.plot(alpha, [expected_speedup(a, k, c, verify_cost) for a in alpha],
                          label=f"formula, c = {c:.2f} ({label})")
        colors[label] = line.get_color()
    for label, (a, _c, speedup) in measured.items():
        ax.plot(a, speedup, "o", ms=8, mec="black", color=colors.get(label, "black"),
                label=f"measured: {label} ({speedup:.2f}×)")
    ax.axhline(1, color="black", lw=1)
    ax.text(0.01, 1.02, "plain decoding", fontsize=8, va="bottom")
    ax.set_xlabel("α, the chance a guess is accepted (given the ones before it)")
    ax.set_ylabel("speed-up over plain decoding")
    ax.set_title(f"Expected speed-up, k = {k}, verify pass = {verify_cost:.2f} steps", fontsize=10)
    ax.legend(fontsize=7.5, loc="upper left")
    return fig


# ---- the explorer ---------------------------------------------------------------------------------

EXPLORER_PROMPT = ("A decode step of llama-7b on one A100 80GB\n\nEach step reads the fp16 weights once."
                   "\n\nA decode")
EXPLORER_K, EXPLORER_STEPS, EXPLORER_BLOCK = 4, 12, 8
DRAFTERS = ("prompt lookup", "kvlab-tiny-draft")
CACHE_WINDOW = 40  # cache positions the explorer draws: the newest ones, from a block boundary


@dataclass(frozen=True)
class SpecFrame:
    """One step of a recorded speculative decode: the tokens before it (the last one not cached
    yet), the step kvlab.speculative recorded, and the cache's block size."""

    tokens: tuple[int, ...]
    step: object            # kvlab.speculative.SpeculativeStep
    prompt_len: int
    block_size: int

    @property
    def kept(self) -> int:
        """Positions the crop keeps: the cache before the step, the fed token, the accepted guesses."""
        return len(self.tokens) + self.step.accepted

    @property
    def added(self) -> tuple[int, ...]:
        s = self.step
        return s.guesses[:s.accepted] + (s.choices[s.accepted],)


@functools.lru_cache(maxsize=4)
def speculation_frames(drafter: str = DRAFTERS[0], k: int = EXPLORER_K, steps: int = EXPLORER_STEPS,
                       prompt: str = EXPLORER_PROMPT) -> tuple[SpecFrame, ...]:
    """The first `steps` draft-and-verify steps of kvlab-tiny on `prompt` with a paged cache of
    EXPLORER_BLOCK-token blocks (recorded once per setting)."""
    from .. import validate
    from ..cache import PagedKVCache
    from ..drafters import ModelDrafter, PromptLookupDrafter
    from ..generate import encode_bytes
    from ..pretrained import load
    from ..speculative import speculative_generate

    drafter = validate.choice("drafter", drafter, DRAFTERS)
    k = validate.integer("k", k, low=1, high=8)
    steps = validate.integer("steps", steps, low=1, high=64)
    model, ids = load("kvlab-tiny"), encode_bytes(prompt)
    guesser = (ModelDrafter(load("kvlab-tiny-draft")) if drafter == "kvlab-tiny-draft"
               else PromptLookupDrafter())
    total = len(ids) + steps * (k + 1) + 1
    cache = PagedKVCache(model.config, 1, total, block_size=EXPLORER_BLOCK)
    run = speculative_generate(model, ids, total - len(ids), guesser, k=k, cache=cache)
    tokens = run.tokens[0].tolist()
    frames, n = [], len(ids) + 1          # the prefill adds the first token
    for step in run.steps[:steps]:
        frames.append(SpecFrame(tuple(tokens[:n]), step, len(ids), EXPLORER_BLOCK))
        n += step.new_tokens
    return tuple(frames)


def _label(token: int) -> str:
    """A byte as a short readable label."""
    if token == 32:
        return "␣"
    if token == 10:
        return "↵"
    return chr(token) if 32 < token < 127 else f"{token:02x}"


def speculation_readout(frames: tuple[SpecFrame, ...], step: int) -> str:
    """What one step did, in words: the guesses, the target's choices, what was kept, the cache."""
    from ..memory import format_bytes

    f = frames[step]
    s = f.step
    guess = "".join(map(_label, s.guesses))
    if not s.proposed:
        verdict = "no guess (no earlier match): the pass only adds the target's own token"
    elif s.accepted == s.proposed:
        verdict = f"all {s.proposed} accepted, plus the target's bonus token {_label(s.choices[-1])!r}"
    else:
        verdict = (f"{s.accepted} accepted; first rejection at guess {s.accepted + 1} "
                   f"({_label(s.guesses[s.accepted])!r}, the target wants {_label(s.choices[s.accepted])!r})")
    blocks = (f"; blocks {s.before.blocks} → {s.after.blocks} ({s.blocks_freed} freed)"
              if s.before.blocks is not None else "")
    return (f"step {step + 1} of {len(frames)}: the draft proposed {guess!r} ({s.proposed} guesses); "
            f"{verdict}\n"
            f"added {_tokens(s.new_tokens)} for 1 target pass: {''.join(map(_label, f.added))!r}\n"
            f"cache: {len(f.tokens) - 1} positions before, {s.before.seq_len} after the verify pass, "
            f"cropped to {s.after.seq_len}{blocks}; pool {format_bytes(s.after.nbytes)}")


def _tokens(n: int) -> str:
    return f"{n} token" + ("" if n == 1 else "s")


def plot_speculation_step(frames: tuple[SpecFrame, ...], step: int):
    """One step of a speculative decode: above, the guesses against the target's choices (accepted
    green, the first rejection red, the guesses after it never judged, the token the target adds
    orange); below, the cache after the verify pass and after the crop, one cell a position, block
    boundaries drawn and freed blocks hatched. Returns the Figure."""
    from .. import validate

    step = validate.integer("step", step, low=0, high=len(frames) - 1)
    f = frames[step]
    s = f.step
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 4.2), height_ratios=(1.1, 1), layout="constrained")
    _draw_guesses(top, f)
    _draw_cache(bottom, f)
    fig.suptitle(f"step {step + 1}: {s.accepted} of {s.proposed} guesses accepted, {_tokens(s.new_tokens)} "
                 "for one target pass", fontsize=10)
    return fig


def _draw_guesses(ax, f: SpecFrame) -> None:
    s = f.step
    ax.set_axis_off()
    context = "".join(map(_label, f.tokens[-40:]))
    ax.set_xlim(-0.5, 12)
    ax.set_ylim(-2.6, 1.0)
    ax.text(-0.5, 0.6, f"context …{context}", fontsize=9, family="monospace", va="center")
    ax.text(-0.5, -0.5, "draft guesses", fontsize=9, va="center")
    ax.text(-0.5, -1.7, "target's choice", fontsize=9, va="center")
    for j in range(s.proposed + 1):
        x = 2.0 + j * 1.1
        if j < s.proposed:
            face = ACCEPT_FACE if j < s.accepted else REJECT_FACE if j == s.accepted else UNJUDGED_FACE
            _chip(ax, x, -0.5, _label(s.guesses[j]), face)
        face = NEW_FACE if j == s.accepted else ACCEPT_FACE if j < s.accepted else UNJUDGED_FACE
        _chip(ax, x, -1.7, _label(s.choices[j]), face)
        mark = "=" if j < s.accepted else "≠" if j == s.accepted and j < s.proposed else ""
        ax.text(x, -1.1, mark, ha="center", va="center", fontsize=11)
    ax.text(2.0 + (s.proposed + 1) * 1.1, -1.1, "green: accepted · red: first rejection · orange: the "
            "target's own token\n(the correction, or a bonus when all are accepted) · grey: never judged",
            fontsize=8, va="center")


def _chip(ax, x: float, y: float, text: str, face: str) -> None:
    ax.add_patch(plt.Rectangle((x - 0.45, y - 0.38), 0.9, 0.76, facecolor=face, edgecolor="#555555", lw=0.8))
    ax.text(x, y, text, ha="center", va="center", fontsize=10, family="monospace")


def _draw_cache(ax, f: SpecFrame) -> None:
    """Two rows of cells: the cache after the verify pass (above) and after the crop (below), its
    newest CACHE_WINDOW positions from a block boundary."""
    s = f.step
    before_step = len(f.tokens) - 1   # cached positions when the step began
    start = max(0, (before_step - CACHE_WINDOW + 2 * f.block_size) // f.block_size * f.block_size)
    for row, length in ((1, s.before.seq_len), (0, s.after.seq_len)):
        for pos in range(start, s.before.seq_len):
            if pos < f.prompt_len:
                face = PROMPT_FACE
            elif pos < before_step:
                face = CACHED_FACE
            elif pos == before_step:
                face = NEW_FACE
            else:
                face = ACCEPT_FACE if pos < f.kept else REJECT_FACE
            dropped = pos >= length
            ax.add_patch(plt.Rectangle((pos, row + 0.1), 1, 0.8, facecolor="white" if dropped else face,
                                       edgecolor="#999999" if dropped else "#555555", lw=0.4,
                                       ls="--" if dropped else "-"))
    blocks = -(-s.before.seq_len // f.block_size)
    kept_blocks = -(-s.after.seq_len // f.block_size)
    for b in range(start // f.block_size, blocks + 1):
        ax.axvline(b * f.block_size, ymin=0.02, ymax=0.98, color="black", lw=1.2)
    for b in range(kept_blocks, blocks):
        ax.add_patch(plt.Rectangle((b * f.block_size, 0.05), f.block_size, 0.9, fill=False, hatch="///",
                                   edgecolor="#C44E52", lw=0))
    ax.set_xlim(start, start + CACHE_WINDOW)
    ax.set_ylim(-0.1, 2.1)
    ax.set_yticks([0.5, 1.5], [f"after the crop: {s.after.seq_len}", f"after verify: {s.before.seq_len}"])
    ax.set_xlabel(f"cache position (the newest; black lines: blocks of {f.block_size}; hatched: a block "
                  f"the crop freed; {s.blocks_freed} this step)")
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.legend(handles=_cache_legend(), loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=6,
              fontsize=8, frameon=False, handlelength=1.2, columnspacing=1.2)


def _cache_legend() -> list:
    """The cache rows' colours: not the chips' (there grey is a guess never judged, and only the
    first rejection is red; here every rejected position is red, grey is the prompt)."""
    from matplotlib.patches import Patch

    cells = [(PROMPT_FACE, "prompt"), (CACHED_FACE, "tokens of earlier steps"),
             (NEW_FACE, "the token fed first"), (ACCEPT_FACE, "accepted guesses"),
             (REJECT_FACE, "rejected positions (cropped)")]
    return ([Patch(facecolor=face, edgecolor="#555555", lw=0.6, label=label) for face, label in cells]
            + [Patch(facecolor="white", edgecolor="#999999", ls="--", lw=0.6, label="dropped by the crop")])


def speculation_explorer():
    """Play through a speculative decode of kvlab-tiny: the step slider (or Play) moves through the
    steps (counted from 1; the drawing functions take the index, step - 1), the drafter dropdown
    chooses who guesses. Frames are recorded once per drafter."""
    import ipywidgets as w

    last = EXPLORER_STEPS   # the slider counts steps from 1, as the picture and the readout do
    step = w.IntSlider(value=1, min=1, max=last, description="step", continuous_update=True)
    play = w.Play(value=1, min=1, max=last, step=1, interval=1500, description="Play")
    w.jslink((play, "value"), (step, "value"))
    drafter = w.Dropdown(options=list(DRAFTERS), value=DRAFTERS[0], description="drafter",
                         layout=w.Layout(width="260px"))
    readout = w.HTML()
    readout.add_class("kvlab-readout")

    def draw(step, drafter):
        frames = speculation_frames(drafter)
        return plot_speculation_step(frames, step - 1), speculation_readout(frames, step - 1)

    out = explorer_plot(draw, {"step": step, "drafter": drafter}, readout)
    out.layout.height = "440px"
    box = w.VBox([w.HBox([play, step, drafter]), out, readout])
    box.add_class("kvlab-speculation-explorer")
    return box


# ---- exercises ------------------------------------------------------------------------------------

TPS_ALPHA, TPS_K = 0.8, 4          # exercise 1: tokens per verify pass


def check_tokens_per_step(answer) -> Verdict:
    """Exercise 1: tokens one verify pass yields on average, each of k = 4 guesses accepted with
    probability 0.8 given the ones before it (Leviathan et al. 2023)."""
    a, k = TPS_ALPHA, TPS_K
    expected = expected_tokens_per_step(a, k)
    wrong = {k * a + 1: "a guess counts only when every guess before it was accepted too: the i-th "
                        "survives with probability α^i, not α.",
             expected - 1: "that counts the accepted guesses; the pass also adds the target's own token "
                           "(the correction or the bonus).",
             (1 - a ** k) / (1 - a): "that sums up to α^(k−1) = α³: k guesses plus the target's token make "
                                     "k + 1 terms, 1 + α + … + α^k.",
             float(k + 1): "that is the best case, every guess right."}
    for value, hint in wrong.items():
        if close(answer, value, 1e-3) and not close(value, expected, 1e-3):
            return report(False, "", hint)
    return numeric(answer, expected, 1e-3,
                   f"Right: 1 + α + α² + α³ + α⁴ = (1 − α⁵)/(1 − α) = {expected:.4f} tokens a pass.",
                   "add up the chances that the pass yields a 1st, 2nd, … token: the target's own token "
                   "always, guess i when guesses 1..i were all accepted.")


KEPT_CACHED, KEPT_K, KEPT_ACCEPTED = 20, 4, 2  # exercise 2: the cache before, guesses, accepted


def check_positions_kept(answer) -> Verdict:
    """Exercise 2: the cache held positions 0..19 and the last token (position 20) was not cached
    yet; the verify pass fed it and 4 guesses (positions 20..24); guesses 1 and 2 were accepted, the
    3rd rejected. Which positions does the crop keep? (a list or range of ints)."""
    keep = KEPT_CACHED + 1 + KEPT_ACCEPTED
    positions = _int_list(answer)
    if positions is None:
        return report(False, "", f"answer with the positions, a list or range of ints such as "
                                 f"list(range(5)), or a 1-d integer array (got {shown(answer)}).")
    if positions == list(range(keep)):
        return report(True, f"Right: positions 0..{keep - 1} ({keep} of them): the old cache, the fed "
                            f"token and the {KEPT_ACCEPTED} accepted guesses; crop({keep}) forgets the "
                            "rest.", "")
    hints = {KEPT_CACHED + 1 + KEPT_K: "that keeps the rejected guesses: a crop removes them.",
             keep + 1: "the third guess was rejected: its position goes too (the target's correction "
                       "is not in the cache yet; the next pass feeds it).",
             keep - 1: "the token fed first (position 20) was never a guess: it stays, with the "
                       "accepted guesses after it.",
             KEPT_CACHED: "the accepted guesses stay in the cache: their K and V are right."}
    if positions == list(range(len(positions))) and len(positions) in hints:
        return report(False, "", hints[len(positions)])
    return report(False, "", "a crop keeps a prefix 0..n-1: the positions before the step, the token fed "
                             "at position 20, and one position per accepted guess.")


def _int_list(answer) -> list[int] | None:
    """answer as a list of ints (a list, tuple or range of whole numbers, NumPy or PyTorch integers
    among them, or a 1-d integer NumPy array or PyTorch tensor), else None."""
    import numpy as np
    import torch

    if isinstance(answer, torch.Tensor):
        d = answer.dtype
        integer = not (d.is_floating_point or d.is_complex or d == torch.bool)
        return [int(p) for p in answer.tolist()] if answer.dim() == 1 and integer else None
    if isinstance(answer, np.ndarray):
        integer = np.issubdtype(answer.dtype, np.integer)
        return [int(p) for p in answer.tolist()] if answer.ndim == 1 and integer else None
    if not isinstance(answer, (list, tuple, range)):
        return None
    if not all(isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in answer):
        return None
    return [int(p) for p in answer]


class ExerciseKVCache(DynamicKVCache):
    """Exercise 3's simple cache: per layer, `keys[layer]` and `values[layer]` of shape
    (batch, kv_heads, positions, head_dim), grown by concatenation, and `lengths[layer]`, the
    positions it holds. Its `crop(n)` calls the learner's `crop_fn(cache, n)`."""

    def __init__(self, config, crop_fn):
        super().__init__(config)
        self.crop_fn = crop_fn

    def crop(self, n: int) -> None:
        self.crop_fn(self, self._crop_length(n))


# The rollbacks of exercise 3: (tokens fed, then crop to n) — a prefill, verify passes that reject
# guesses, and one that accepts everything.
CROP_SCRIPT = ((12, 12), (5, 14), (5, 16), (5, 21), (3, 22), (5, 23))


SLICE_ADVICE = ("slice dim 2, the positions, of every layer's keys and values to their first n "
                "(cache.keys[layer] = cache.keys[layer][:, :, :n], the same for cache.values) and set "
                "cache.lengths = [n] * len(cache.keys)")


def check_crop(answer) -> Verdict:
    """Exercise 3: `answer(cache, n)` keeps the first n positions of an ExerciseKVCache. Checked with
    kvlab.oracle on kvlab-tiny through speculative-decoding-like passes and crops: after each crop
    the cache's tensors must hold n positions each (the usual mistakes named), and the next pass must
    see exactly what feeding only the kept tokens would have put there."""
    import torch

    from .. import oracle
    from ..generate import encode_bytes
    from ..pretrained import load

    if not callable(answer):
        return report(False, "", f"answer = your crop function itself, not its result (got {shown(answer)}).")
    model = load("kvlab-tiny")
    ids = torch.tensor([encode_bytes("Speculation guesses, the target checks, the cache rolls back.")])
    cache = ExerciseKVCache(model.config, answer)
    check = oracle.Oracle(model, cache)
    for feed, keep in CROP_SCRIPT:
        start = check.tokens.shape[1]
        fed = start + feed
        try:
            check.feed(ids[:, start:fed])
        except Exception as err:  # noqa: BLE001 - a learner's bug is a hint, never a traceback
            return report(False, "", f"the pass after your crop failed ({type(err).__name__}: {err}); "
                                     f"{SLICE_ADVICE}.")
        try:
            check.crop(keep)
        except Exception as err:  # noqa: BLE001
            return report(False, "", f"crop({keep}) raised {type(err).__name__}: {err} (after {fed} "
                                     f"positions were fed); {SLICE_ADVICE}.")
        mistake = _crop_mistake(cache, keep, fed)
        if mistake:
            return report(False, "", mistake)
        if check.report.first is not None:
            return report(False, "", f"after feeding {fed} positions and cropping to {keep}: "
                                     f"{check.report.first}. Keep the *first* n positions: {SLICE_ADVICE}.")
    return report(True, f"Right: the oracle agrees after every crop ({check.report.passes} passes: "
                        "prefill, verify passes, crops).", "")


def _crop_mistake(cache: ExerciseKVCache, n: int, held: int) -> str | None:
    """The usual mistakes of a crop from `held` to n positions, named from the cache's shapes and
    lengths; None when every layer's keys and values hold n positions and lengths says n."""
    import torch

    layers, cfg = len(cache.keys), cache.config
    tensors = {side: getattr(cache, side) for side in ("keys", "values")}
    for side, ts in tensors.items():
        for layer, t in enumerate(ts):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                return (f"after crop({n}), cache.{side}[{layer}] is {shown(t)}, not a 4-d tensor: "
                        f"{SLICE_ADVICE}.")
            if (t.shape[0], t.shape[1], t.shape[3]) != (1, cfg.n_kv_heads, cfg.head_dim):
                return (f"after crop({n}), cache.{side}[{layer}] has shape {tuple(t.shape)}: another axis "
                        "than the positions was sliced (the shape is (batch, kv_heads, positions, "
                        f"head_dim)); {SLICE_ADVICE}.")
    counts = {side: [t.shape[2] for t in ts] for side, ts in tensors.items()}
    lengths_right = list(cache.lengths) == [n] * layers
    if counts["keys"] == counts["values"] == [n] * layers:
        if lengths_right:
            return None
        return (f"the tensors hold {n} positions, but cache.lengths is {list(cache.lengths)}: set "
                "cache.lengths = [n] * len(cache.keys).")
    if all(c == held for side in counts for c in counts[side]):
        if lengths_right:
            return (f"crop({n}) set cache.lengths to {n}, but cache.keys[0] still holds {held} positions: "
                    "rolling back is not just shortening a length (the rejected rows stay, and the next "
                    "pass appends after them). Slice the positions, dim 2, of every layer's keys and "
                    "values ([:, :n] slices dim 1, the heads): cache.keys[layer] = "
                    "cache.keys[layer][:, :, :n], the same for cache.values.")
        return (f"crop({n}) left the cache as it was (cache.keys[0] still holds {held} positions): change "
                f"the cache in place, nothing returned is used; {SLICE_ADVICE}.")
    side, layer = next((side, i) for side in counts for i, c in enumerate(counts[side]) if c != n)
    m = counts[side][layer]
    if side == "values" and counts["keys"] == [n] * layers:
        return (f"the keys hold {n} positions, but cache.values[{layer}] still holds {m}: slice the "
                "values too (cache.values[layer][:, :, :n]).")
    if layer > 0 and counts[side][0] == n:
        return (f"cache.{side}[0] holds {n} positions, but cache.{side}[{layer}] still holds {m}: crop "
                "every layer (for layer in range(len(cache.keys)): ...[:, :, :n]).")
    return f"after crop({n}), cache.{side}[{layer}] holds {m} positions, not {n}: {SLICE_ADVICE}."

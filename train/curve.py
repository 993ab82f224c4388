"""The learning curve: a short table on stdout and, with matplotlib, a PNG."""

from __future__ import annotations


def curve_table(curve: list[dict]) -> str:
    """One line per validation point: step, minutes, train loss, validation loss, accuracy by rollout step,
    estimated acceptance length.

    >>> print(curve_table([{"step": 0, "elapsed": 0.0, "train_loss": None, "val_loss": 3.0, "val_acc": [0.5],
    ...                     "val_accept_len": 1.5}]))
     step    min  train loss  val loss  val acc by step  est. accept len
        0    0.0           -     3.000             0.50             1.50
    """
    lines = [f"{'step':>5} {'min':>6} {'train loss':>11} {'val loss':>9} {'val acc by step':>16} "
             f"{'est. accept len':>16}"]
    for p in curve:
        tl = "-" if p.get("train_loss") is None else f"{p['train_loss']:.3f}"
        vl = f"{p['val_loss']:.3f}" if "val_loss" in p else "-"
        acc = "/".join(f"{a:.2f}" for a in p.get("val_acc", []))
        el = f"{p['val_accept_len']:.2f}" if "val_accept_len" in p else "-"
        lines.append(f"{p['step']:>5} {p['elapsed'] / 60:>6.1f} {tl:>11} {vl:>9} {acc:>16} {el:>16}")
    return "\n".join(lines)


def draw_curve(curve: list[dict], path: str, title: str = "EAGLE-3 head training") -> None:
    """Loss (train and validation) and validation accuracy by rollout step against training minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mins = [p["elapsed"] / 60 for p in curve]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    tr = [(m, p["train_loss"]) for m, p in zip(mins, curve) if p.get("train_loss") is not None]
    if tr:
        a1.plot(*zip(*tr), label="train (EMA)")
    va = [(m, p["val_loss"]) for m, p in zip(mins, curve) if "val_loss" in p]
    if va:
        a1.plot(*zip(*va), label="validation")
    a1.set_xlabel("training minutes")
    a1.set_ylabel("rollout cross-entropy")
    a1.legend()
    steps = max((len(p.get("val_acc", [])) for p in curve), default=0)
    for k in range(steps):
        pts = [(m, p["val_acc"][k]) for m, p in zip(mins, curve) if len(p.get("val_acc", [])) > k]
        a2.plot(*zip(*pts), label=f"draft step {k + 1}")
    el = [(m, p["val_accept_len"]) for m, p in zip(mins, curve) if "val_accept_len" in p]
    if el:
        ax = a2.twinx()
        ax.plot(*zip(*el), "k--", label="est. acceptance length")
        ax.set_ylabel("est. acceptance length (k--)")
    a2.set_xlabel("training minutes")
    a2.set_ylabel("validation top-1 = target's top token")
    a2.set_ylim(0, 1)
    a2.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

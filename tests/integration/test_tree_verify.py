"""A draft tree verified in one decode, on the real model: each branch a sequence id of one KV pool, a node
shared by branches one row carrying all their ids (engine/draft_tree.py, TargetRunner._verify_tree).

The target runs as trees run, over one KV pool with flash attention; a tree's rows are compared bit for bit with
each branch's path decoded alone (these few-row batches come out the same here), and after the verify the
sequence's cells must decode as target-only decoding would. Without flash attention a runner-up's rows depend on
where its cells lie: the attention then sums over every cell up to the last, masked ones included, and a rejected
sibling's cell between the runner-up's moves its terms in that sum. The masks still isolate the branches: with a
filler cell at the sibling's place, the path decoded alone gives the same rows bit for bit (the last test)."""

from __future__ import annotations

import numpy as np
import pytest

from specray.engine.draft_tree import DraftTree
from specray.engine.sampling import SamplingParams
from specray.engine.target import StepItem, TargetRunner
from specray.native.context import Context

pytestmark = pytest.mark.model

PROMPT = "The three laws of motion are the foundation of classical mechanics. The first law says that"


def _ctx(model, n_seq_max: int = 4, flash_attn: bool = True) -> Context:
    return Context(model, n_ctx=1024, n_seq_max=n_seq_max, n_batch=256, flash_attn=flash_attn, kv_unified=True,
                   n_threads=2)


def _greedy(model, tokens: np.ndarray, n: int) -> list[int]:
    """The target's own greedy continuation of `tokens`, one token per decode, in a fresh context."""
    ctx = _ctx(model, 1)
    b = ctx.batch
    b.clear(); b.add_seq(0, tokens, 0, 1)  # noqa: E702
    out = [int(ctx.decode()[0].argmax())]
    for i in range(n - 1):
        b.clear(); b.add_seq(0, np.array([out[-1]], np.int32), len(tokens) + i, 1)  # noqa: E702
        out.append(int(ctx.decode()[0].argmax()))
    ctx.close()
    return out


def _path_rows(model, prefix: np.ndarray, root: int, path: list[int], flash_attn: bool = True) -> np.ndarray:
    """Logits rows of [root] + path decoded as one linear draft after `prefix`, alone in a fresh context."""
    ctx = _ctx(model, 1, flash_attn)
    b = ctx.batch
    b.clear(); b.add_seq(0, prefix, 0, 0); ctx.decode()  # noqa: E702
    b.clear(); b.add_seq(0, np.array([root] + path, np.int32), len(prefix), len(path) + 1)  # noqa: E702
    rows = ctx.decode().copy()
    ctx.close()
    return rows


def test_each_branch_sees_only_its_own_path(smollm2):
    tokens = smollm2.tokenize(PROMPT)
    prefix, root = tokens[:-1], int(tokens[-1])
    tree = DraftTree.build([11, 12, 13], [(0, [21, 22]), (1, [31])])
    ctx = _ctx(smollm2)
    b = ctx.batch
    b.clear(); b.add_seq(0, prefix, 0, 0); ctx.decode()  # noqa: E702
    ids = [0, 1, 2]
    for s in ids[1:]:
        ctx.seq_cp(0, s)
    b.clear()
    b.add_rows(np.concatenate([[root], tree.tokens]).astype(np.int32),
               np.concatenate([[len(prefix)], len(prefix) + 1 + tree.depths]),
               [[ids[x] for x in row] for row in tree.row_branches()])
    rows = ctx.decode().copy()
    ctx.close()
    for leaf in tree.leaves:
        path = tree.path(leaf)
        want = _path_rows(smollm2, prefix, root, tree.tokens[path].tolist())
        got = rows[[0] + [1 + n for n in path]]
        assert np.array_equal(got, want), f"branch ending at node {leaf}: max diff {np.abs(got - want).max()}"


@pytest.mark.parametrize("shape", ["runner_up_taken", "main_taken", "none_taken"])
def test_the_accepted_path_becomes_the_sequences_own_cells(smollm2, shape):
    tokens = smollm2.tokenize(PROMPT)
    g = _greedy(smollm2, tokens, 12)  # g[0] is the token after the prompt
    bad = (g[1] + 1) % 1000 + 5
    tree, kept = {
        # main takes g1, leaves it at depth 1; the runner-up at depth 1 goes on with g2 g3
        "runner_up_taken": (DraftTree.build([g[1], bad, g[3]], [(1, [g[2], g[3], bad]), (0, [bad + 1])]), 3),
        "main_taken": (DraftTree.build([g[1], g[2]], [(0, [bad, g[2]]), (1, [bad])]), 2),
        "none_taken": (DraftTree.build([bad], [(0, [bad + 1, g[2]])]), 0),
    }[shape]
    ctx = _ctx(smollm2)
    runner = TargetRunner(ctx, branch_seqs=range(1, 4))
    runner.start(0, SamplingParams(), tokens)
    first = runner.step([StepItem(0, tokens, 0)]).results[0]
    assert first.tokens.tolist() == [g[0]]
    n = len(tokens)
    res = runner.step([StepItem(0, np.array([g[0], *tree.tokens], np.int32), n, len(tree), tree=tree)]).results[0]
    assert res.error is None
    assert res.tokens.tolist() == g[1 : kept + 2] and res.n_accepted == kept
    assert res.branch == (1 if shape == "runner_up_taken" else 0)
    assert runner.tree_items == 1
    # the branch ids hold nothing, the sequence exactly its committed tokens
    assert [ctx.seq_pos_max(s) for s in (1, 2, 3)] == [-1, -1, -1]
    assert ctx.seq_pos_max(0) == n + kept
    # and they decode as target-only decoding would: the next tokens, one per round
    pos, last, out = n + kept + 1, int(res.tokens[-1]), []
    for _ in range(12 - kept - 2):
        r = runner.step([StepItem(0, np.array([last], np.int32), pos)]).results[0]
        last = int(r.tokens[0])
        out.append(last)
        pos += 1
    assert out == g[kept + 2 :]
    ctx.close()


def _tree_rows(model, tokens: np.ndarray, root: int, tree: DraftTree, flash_attn: bool) -> np.ndarray:
    """The rows of [root] + the tree decoded in one batch after `tokens`, each branch a sequence id."""
    ctx = _ctx(model, tree.n_branches, flash_attn)
    b = ctx.batch
    b.clear(); b.add_seq(0, tokens, 0, 0); ctx.decode()  # noqa: E702
    for s in range(1, tree.n_branches):
        ctx.seq_cp(0, s)
    b.clear()
    b.add_rows(np.concatenate([[root], tree.tokens]).astype(np.int32),
               np.concatenate([[len(tokens)], len(tokens) + 1 + tree.depths]), tree.row_branches())
    rows = ctx.decode().copy()
    ctx.close()
    return rows


def test_a_runner_ups_rows_after_a_siblings_rows_are_its_path_decoded_alone(smollm2):
    """With flash attention: the tree's main draft leaves the target's continuation at depth 1 and the runner-up
    holds it, so the runner-up's rows come after the main draft's in the batch. They must equal the target's
    continuation decoded alone, bit for bit: llama.cpp's CPU kernel skips masked cells, wherever they lie."""
    tokens = smollm2.tokenize(PROMPT)
    g = _greedy(smollm2, tokens, 5)
    bad = (g[1] + 1) % 1000 + 5
    tree = DraftTree.build([g[1], bad], [(1, [g[2], g[3]])])
    rows = _tree_rows(smollm2, tokens, g[0], tree, flash_attn=True)
    path = tree.path(tree.leaves[1])
    want = _path_rows(smollm2, tokens, g[0], tree.tokens[path].tolist(), flash_attn=True)
    assert np.array_equal(rows[[0] + [1 + n for n in path]], want)


def test_without_flash_attention_a_runner_ups_rows_are_its_path_decoded_with_the_same_cell_layout(smollm2):
    """Without flash attention, the same tree: the runner-up's rows equal its path decoded alone with a filler
    cell of another sequence where the main draft's rejected token lies (a row's terms land where its cells
    do), bit for bit. So the masks isolate the branches; what moves is where the cells lie, as other slots'
    cells move a sequence's logits in fast mode, which near-tie checks allow for (test_tree_lossless.py)."""
    tokens = smollm2.tokenize(PROMPT)
    n = len(tokens)
    g = _greedy(smollm2, tokens, 5)
    bad = (g[1] + 1) % 1000 + 5
    tree = DraftTree.build([g[1], bad], [(1, [g[2], g[3]])])
    rows = _tree_rows(smollm2, tokens, g[0], tree, flash_attn=False)
    path = tree.path(tree.leaves[1])
    assert tree.tokens[path].tolist() == g[1:4]
    ctx = _ctx(smollm2, 2, flash_attn=False)
    b = ctx.batch
    b.clear(); b.add_seq(0, tokens, 0, 0); ctx.decode()  # noqa: E702
    b.clear()  # the filler (sequence 1) takes the cell after g1's, as `bad` does in the tree's batch
    b.add_rows(np.array([g[0], g[1], bad, g[2], g[3]], np.int32), np.array([n, n + 1, n + 2, n + 2, n + 3]),
               [[0], [0], [1], [0], [0]])
    alone = ctx.decode().copy()
    ctx.close()
    assert np.array_equal(rows[[0] + [1 + i for i in path]], alone[[0, 1, 3, 4]])

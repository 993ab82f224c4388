"""specray.train without a model: the rollout against a step-by-step draft, batching, vocabulary, prompts,
the command line's errors, and the modules' docstring examples."""

from __future__ import annotations

import doctest
import json

import numpy as np
import pytest


@pytest.mark.parametrize("module", ["vocab", "data", "curve", "self_prompts", "run", "text", "labels"])
def test_docstring_examples(module):
    import importlib

    mod = importlib.import_module(f"specray.train.{module}")
    failed, attempted = doctest.testmod(mod)
    assert attempted > 0 and failed == 0


@pytest.mark.parametrize("module", ["head", "ttt", "loop"])
def test_docstring_examples_torch(module):
    pytest.importorskip("torch")
    import importlib

    mod = importlib.import_module(f"specray.train.{module}")
    failed, attempted = doctest.testmod(mod)
    assert attempted > 0 and failed == 0


def _tiny_head(seed: int = 0):
    torch = pytest.importorskip("torch")
    from specray.train.head import Dims, Eagle3Module

    torch.manual_seed(seed)
    d = Dims(n_embd=32, n_head=4, n_head_kv=2, n_ff=48, target_width=16, n_vocab=50, draft_vocab=20,
             target_layers=(1, 2, 3), rope_base=100.0)
    m = Eagle3Module(d, torch.randn(50, 32), torch.arange(0, 40, 2))
    with torch.no_grad():
        for name in ("attn_norm", "hidden_norm", "ffn_norm", "output_norm"):
            getattr(m, name).add_(0.2 * torch.randn(32))
    return m


def _random_batch(T: int):
    """Two sequences of T positions for _tiny_head: rows, tokens, and labels (-1: off the draft vocabulary)."""
    torch = pytest.importorskip("torch")
    return torch.randn(2, T, 48), torch.randint(0, 50, (2, T)), torch.randint(-1, 20, (2, T))


def test_rollout_is_what_the_speculator_drafts_step_by_step():
    """Row s of rollout step k == a plain causal pass over the committed pairs 0..s followed by the draft's own
    pairs (x_{s+j}, h_{j-1}) at s+j-1, j = 2..k: the KV cache the speculator builds while drafting."""
    torch = pytest.importorskip("torch")
    from specray.train.ttt import rollout

    m = _tiny_head()
    T = 9
    feats = torch.randn(1, T, 48) * 3
    tokens = torch.randint(0, 50, (1, T))
    with torch.no_grad():
        steps = rollout(m, feats, tokens, 3)
        g = m.encode(feats[0, : T - 1])
        for s in range(T - 3):
            toks = [int(tokens[0, p + 1]) for p in range(s + 1)]  # committed pairs (x_{p+1}, g_p), p = 0..s
            rows = [g[p] for p in range(s + 1)]
            h = m.forward_pairs(torch.tensor([toks]), torch.stack(rows)[None])[0, -1]
            assert torch.allclose(steps[0][0, s], h, atol=1e-5)
            for k in (2, 3):
                toks.append(int(tokens[0, s + k]))
                rows.append(h)
                h = m.forward_pairs(torch.tensor([toks]), torch.stack(rows)[None])[0, -1]
                assert torch.allclose(steps[k - 1][0, s], h, atol=1e-4), (s, k)


def test_rollout_from_a_later_row_is_the_same_rows():
    torch = pytest.importorskip("torch")
    from specray.train.ttt import rollout

    m = _tiny_head(3)
    feats, tokens = torch.randn(2, 11, 48), torch.randint(0, 50, (2, 11))
    with torch.no_grad():
        full = rollout(m, feats, tokens, 3)
        late = rollout(m, feats, tokens, 3, start=4)
    assert torch.equal(full[0], late[0])
    for k in (1, 2):
        assert late[k].shape[1] == 10 - 4 and torch.allclose(full[k][:, 4:], late[k], atol=1e-5)


def test_rollout_of_a_padded_batch_matches_each_sequence_alone():
    torch = pytest.importorskip("torch")
    from specray.train.ttt import rollout

    m = _tiny_head(1)
    a, b = torch.randint(0, 50, (1, 10)), torch.randint(0, 50, (1, 6))
    fa, fb = torch.randn(1, 10, 48), torch.randn(1, 6, 48)
    tokens = torch.zeros(2, 10, dtype=torch.int64)
    feats = torch.zeros(2, 10, 48)
    tokens[0], feats[0] = a[0], fa[0]
    tokens[1, :6], feats[1, :6] = b[0], fb[0]
    with torch.no_grad():
        both = rollout(m, feats, tokens, 2)
        alone = rollout(m, fb, b, 2)
    for k in range(2):
        n = 6 - 1 - k  # rows whose step-k token exists
        assert torch.allclose(both[k][1, :n], alone[k][0, :n], atol=1e-5)


def test_rollout_loss_counts_answer_positions_only_and_learns():
    torch = pytest.importorskip("torch")
    from specray.train.ttt import rollout_loss

    m = _tiny_head(2)
    T = 12
    feats, tokens, labels = _random_batch(T)
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[:, 5:] = True
    _, stats = rollout_loss(m, feats, tokens, labels, mask, 3, 0.8)
    for k, (_, n) in enumerate(stats, start=1):
        # step k's row s counts where label s+k is an answer label (>= 0) within the sequence
        want = sum(int(labels[b, s + k] >= 0) for b in range(2) for s in range(T - 1) if 5 <= s + k < T)
        assert n == want
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss, _ = rollout_loss(m, feats, tokens, labels, mask, 3, 0.8)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first


def test_collate_counts_prompt_positions_only_when_asked():
    pytest.importorskip("torch")
    from specray.train.data import Sample
    from specray.train.loop import collate

    def sample(n, answer_from):
        return Sample(np.arange(n, dtype=np.int32), np.zeros((n, 6), np.float16), np.arange(n, dtype=np.int32),
                      answer_from)

    batch = [sample(5, 2), sample(3, 3)]  # the second: a prompt kept with no answer
    t2d = np.arange(8)
    assert collate(batch, t2d)[3].tolist() == [[False, False, True, True, True], [False] * 5]
    assert collate(batch, t2d, prompts=True)[3].tolist() == [[True] * 5, [True, True, True, False, False]]


def test_batches_stay_within_the_token_budget():
    pytest.importorskip("torch")
    from specray.train.loop import make_batches

    lengths = list(np.random.default_rng(0).integers(10, 300, 200))
    batches = make_batches(lengths, 1024, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(200))
    assert all(len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 1024 for b in batches)


def test_draft_vocabulary_keeps_the_most_frequent_and_the_end_token():
    from specray.train.vocab import choose_draft_vocab, coverage, to_draft_rows

    counts = np.zeros(100, dtype=np.int64)
    counts[[7, 3, 50]] = [30, 20, 10]
    d2t = choose_draft_vocab(counts, 3, always=(2,))
    assert d2t.tolist() == [2, 3, 7]
    assert coverage(counts, d2t) == pytest.approx(50 / 60)
    t2d = to_draft_rows(d2t, 100)
    assert t2d[7] == 2 and t2d[50] == -1
    with pytest.raises(ValueError, match="draft vocabulary size"):
        choose_draft_vocab(counts, 0)


def test_prompts_by_category(tmp_path):
    from specray.train.prompts import read_prompts

    p = tmp_path / "q.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [
        {"category": "a", "turns": ["one", "two"]}, {"category": "b", "prompt": "raw"},
        {"category": "c", "messages": [{"role": "user", "content": "hi"}]}]) + "\n")
    got = read_prompts(str(p), exclude=["b"])
    assert [x.category for x in got] == ["a", "c"]
    assert got[0].messages == [{"role": "user", "content": "one"}]
    assert [x.prompt for x in read_prompts(str(p), include=["b"])] == ["raw"]
    with pytest.raises(ValueError, match="no prompts left"):
        read_prompts(str(p), include=["a", "b"], skip_first=1)
    assert [x.category for x in read_prompts(str(p), skip_first=0, exclude=["a"])] == ["b", "c"]
    with pytest.raises(ValueError, match="no category z .*it has: a, b, c"):
        read_prompts(str(p), exclude=["z"])


class _ChatML:
    name = "chatml-stub"

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "<|im_start|>system\nBe helpful.<|im_end|>\n" + "".join(
            f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_self_prompts_start_where_a_user_message_goes_and_resume_from_their_file(tmp_path):
    from specray.train.self_prompts import query_prefix, read_self_prompts, write_self_prompts

    assert query_prefix(_ChatML()) == "<|im_start|>system\nBe helpful.<|im_end|>\n<|im_start|>user\n"

    class NoPlace(_ChatML):
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "<|im_start|>user\nfixed<|im_end|>\n"

    with pytest.raises(ValueError, match="does not show where a user message goes"):
        query_prefix(NoPlace())
    path = tmp_path / "own.jsonl"
    path.write_text(json.dumps({"category": "self", "content": "Write a haiku about rain."}) + "\n")
    # a file already there is read back, not written again (the engine is never used)
    got = write_self_prompts(None, 5, str(path), seed=0, temperature=1.0)
    assert got == read_self_prompts(str(path))
    assert [(p.category, p.messages) for p in got] == [
        ("self", [{"role": "user", "content": "Write a haiku about rain."}])]


def test_validation_holds_out_whole_prompts():
    from types import SimpleNamespace

    from specray.train.run import split_by_prompt

    samples = [SimpleNamespace(prompt=p, kind=k) for p in range(40) for k in range(2)]
    val, train = split_by_prompt(samples, 0.1, 3)
    assert len(val) == 8 and len(train) == 72
    assert not {s.prompt for s in val} & {s.prompt for s in train}
    assert split_by_prompt(samples[:2], 0.1, 0) == ([], samples[:2])  # one prompt: all of it trains
    assert split_by_prompt(samples, 0.0, 0) == ([], samples)


def test_train_head_flags_errors_name_the_flag(tmp_path, capsys):
    from specray.cli.main import main

    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"category": "a", "turns": ["x"]}) + "\n")
    base = ["train-head", "--prompts", str(q), "--out", str(tmp_path / "h.gguf")]
    assert main(base + ["--lr", "0"]) == 2
    assert "--lr 0.0: Input should be greater than 0" in capsys.readouterr().err
    assert main(base + ["--categories", "a", "--exclude-categories", "a"]) == 2
    assert "both included and excluded: a" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--target-layers", "1,2"])
    assert "--target-layers" in capsys.readouterr().err
    assert main(base + ["--text", str(q)]) == 2
    assert "--text needs --learn-prompts" in capsys.readouterr().err
    assert main(base + ["--soft-labels", "100"]) == 2
    assert "--soft-labels 100: Input should be less than or equal to 64" in capsys.readouterr().err
    assert main(base + ["--learn-prompts", "--text", str(tmp_path / "none*.txt")]) == 2
    assert "--text" in capsys.readouterr().err


def test_soft_loss_with_all_weight_on_the_top_token_is_the_hard_loss():
    torch = pytest.importorskip("torch")
    from specray.train.ttt import rollout_loss

    m = _tiny_head(4)
    T = 10
    feats, tokens, labels = _random_batch(T)
    mask = torch.ones(2, T, dtype=torch.bool)
    rows = torch.stack((labels, torch.randint(0, 20, (2, T)), torch.full((2, T), -1)), dim=-1)
    one_hot = torch.zeros(2, T, 3)
    one_hot[..., 0] = 1.0
    with torch.no_grad():
        hard, hard_stats = rollout_loss(m, feats, tokens, labels, mask, 3, 0.8)
        soft, soft_stats = rollout_loss(m, feats, tokens, labels, mask, 3, 0.8, soft=(rows, one_hot))
        assert soft.item() == pytest.approx(hard.item(), rel=1e-5) and soft_stats == hard_stats
        # weight moved to another token: another loss, the same accuracy (it is the top token's)
        spread = one_hot.clone()
        spread[..., :2] = 0.5
        other, other_stats = rollout_loss(m, feats, tokens, labels, mask, 3, 0.8, soft=(rows, spread))
    assert other.item() != pytest.approx(hard.item(), rel=1e-3) and other_stats == hard_stats


def test_soft_labels_learn_the_target_distribution():
    torch = pytest.importorskip("torch")
    from specray.train.ttt import rollout_loss

    m = _tiny_head(5)
    T = 8
    feats, tokens = torch.randn(1, T, 48), torch.randint(0, 50, (1, T))
    labels = torch.full((1, T), 3)
    mask = torch.ones(1, T, dtype=torch.bool)
    rows = torch.tensor([3, 7]).expand(1, T, 2)
    w = torch.tensor([0.7, 0.3]).expand(1, T, 2)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(150):
        loss, _ = rollout_loss(m, feats, tokens, labels, mask, 1, 1.0, soft=(rows, w))
        opt.zero_grad()
        loss.backward()
        opt.step()
    from specray.train.ttt import rollout

    with torch.no_grad():
        q = torch.softmax(m.logits(rollout(m, feats, tokens, 1)[0]), dim=-1)[0]
    # the head's probabilities approach the soft labels' (a hard label would push row 3 towards 1)
    assert q[:, 3].mean().item() == pytest.approx(0.7, abs=0.08) and q[:, 7].mean().item() == pytest.approx(0.3, abs=0.08)


def test_collate_soft_maps_to_draft_rows_and_pads():
    pytest.importorskip("torch")
    from specray.train.data import Sample
    from specray.train.loop import collate_soft

    def sample(n, soft=True):
        ids = np.tile(np.array([[4, 1, 6]], dtype=np.int32), (n, 1)) if soft else None
        p = np.tile(np.array([[0.5, 0.25, 0.25]], dtype=np.float16), (n, 1)) if soft else None
        return Sample(np.arange(n, dtype=np.int32), np.zeros((n, 6), np.float16), np.full(n, 4, np.int32), 0,
                      soft_ids=ids, soft_p=p)

    t2d = np.array([-1, 0, -1, -1, 1, -1, -1])  # token 1 -> row 0, token 4 -> row 1, token 6 off the vocabulary
    rows, w = collate_soft([sample(3), sample(2)], t2d)
    assert rows.shape == (2, 3, 3) and rows[0, 0].tolist() == [1, 0, -1] and rows[1, 2].tolist() == [-1, -1, -1]
    assert w[0, 0].tolist() == pytest.approx([2 / 3, 1 / 3, 0.0]) and w[1, 2].tolist() == [0.0, 0.0, 0.0]
    assert collate_soft([sample(3), sample(2, soft=False)], t2d) is None


def test_text_pieces_resume_and_name_missing_files(tmp_path):
    from specray.train.data import _text_pieces, text_piece_id
    from specray.train.text import text_files

    (tmp_path / "a.txt").write_text("x" * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("y" * 90)
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "sub" / "b.txt")
    assert text_files([str(tmp_path / "**" / "*.txt"), a]) == [a, b]
    with pytest.raises(ValueError, match="no such file"):
        text_files([str(tmp_path / "*.md")])

    class CharModel:  # one token per character
        def tokenize(self, text, add_special=True):
            return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)

    from types import SimpleNamespace

    cfg = SimpleNamespace(seed=0, gen=SimpleNamespace(text=[str(tmp_path / "**" / "*.txt")], max_len=40))
    # 40-token pieces; a last piece under 32 tokens is dropped: a.txt makes one, b.txt two
    got = {pid: (cat, t.tolist()) for pid, cat, t in _text_pieces(CharModel(), cfg, set())}
    want = {text_piece_id(0, 0): [ord("x")] * 40, text_piece_id(1, 0): [ord("y")] * 40,
            text_piece_id(1, 1): [ord("y")] * 40}
    assert {pid: t for pid, (_, t) in got.items()} == want and {c for c, _ in got.values()} == {"text"}
    # a resumed run skips the pieces its shards hold
    left = [pid for pid, _, _ in _text_pieces(CharModel(), cfg, {(text_piece_id(1, 0), 0)})]
    assert sorted(left) == sorted([text_piece_id(0, 0), text_piece_id(1, 1)])


def test_text_with_no_answer_loses_no_piece_between_its_two_phases(tmp_path):
    """--rows-minutes: the pieces not decoded before the answers are decoded after them, none skipped."""
    from specray.train.data import Sample, _rows_only, load_samples

    class Rows:  # a stand-in for RowReader: no model
        def sample(self, toks, prompt_len, max_len, category):
            n = len(toks)
            return Sample(np.asarray(toks, np.int32), np.zeros((n, 6), np.float16), np.zeros(n, np.int32),
                          min(n, prompt_len - 1), category)

    pieces = iter([(-1 - i, "text", np.arange(40)) for i in range(5)])
    taken = []

    def first_budget():  # two pieces' worth
        return len(taken) >= 2

    class Counting(Rows):
        def sample(self, *a):
            taken.append(1)
            return super().sample(*a)

    shard, n = _rows_only(None, Counting(), [], [], pieces, 64, str(tmp_path), 0, first_budget, lambda s: None)
    assert (shard, n) == (1, 80)
    shard, n = _rows_only(None, Rows(), [], [], pieces, 64, str(tmp_path), shard, lambda: False, lambda s: None)
    assert (shard, n) == (2, 120)
    assert sorted((s.prompt for s in load_samples(str(tmp_path))), reverse=True) == [-1, -2, -3, -4, -5]

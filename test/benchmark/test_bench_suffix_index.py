"""bench_suffix_index on two code edits and two chats: it runs, and the index drafts the
function text an edit's answer repeats from its prompt."""

from sgl_jax.testing.benchmarks import load_benchmark


def test_edits_draft_from_their_prompt(capsys):
    bench = load_benchmark("bench_suffix_index")
    result = bench.main(["--pairs", "2", "--batch", "2"])
    assert result["requests"] == 4
    # An answer of n tokens takes n / (tokens a proposal commits) proposals; without drafts
    # every proposal would commit exactly the bonus token.
    assert result["tokens_per_proposal"] > 1.5
    assert result["propose_us_per_request"] > 0 and len(result["digest"]) == 16
    assert "proposals (7 nodes, depth 6, batch 2)" in capsys.readouterr().out

"""Two processes on 127.0.0.1 with 2 CPU devices each form one 4-device mesh (--nnodes 2,
--tp-size 4) and give the same greedy outputs as TP 1: through the HTTP server (rank 0
serves, rank 1 follows) with EAGLE3, and through the offline Engine without a draft."""

import subprocess
import sys

import openai
from transformers import AutoTokenizer

from sgl_jax.testing.parallel import (
    ENGINE_SETTINGS,
    MAX_NEW_TOKENS,
    TREE,
    cpu_devices_env,
    prompts,
    run_subprocess,
    transformers_greedy,
    write_tp_checkpoints,
)
from sgl_jax.testing.server import free_port, launch_server


def start_follower(command: list[str], log_path) -> subprocess.Popen:
    """Rank 1, with 2 CPU devices, its output in a file (a full pipe would stall it)."""
    with open(log_path, "w") as log:
        return subprocess.Popen(command, env=cpu_devices_env(2), stdout=log,
                                stderr=subprocess.STDOUT)


def rank_flags(rank: int, address: str) -> list[str]:
    return ["--tp-size", "4", "--nnodes", "2", "--node-rank", str(rank),
            "--dist-init-addr", address]


def server_flags(target, draft) -> list[str]:
    flags = ["--model-path", str(target), "--speculative-algorithm", "EAGLE3",
             "--speculative-draft-model-path", str(draft)]
    for name, value in {**ENGINE_SETTINGS, **TREE}.items():
        option = "--" + name.replace("_", "-")
        if value is True:
            flags.append(option)
        else:
            flags += [option, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return flags


def test_http_server_across_two_processes_matches_tp1(tmp_path):
    target, draft = write_tp_checkpoints(tmp_path, "qwen2")
    tokenizer = AutoTokenizer.from_pretrained(target)
    vocab = 514
    expected = [tokenizer.decode(ids) for ids in transformers_greedy(target)]
    address = f"127.0.0.1:{free_port()}"
    flags = server_flags(target, draft)
    follower = start_follower([sys.executable, "-m", "sgl_jax.launch_server", *flags,
                               *rank_flags(1, address)], tmp_path / "rank1.log")
    try:
        with launch_server([*flags, *rank_flags(0, address)], env=cpu_devices_env(2)) as server:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none",
                                   max_retries=0)
            texts = [client.completions.create(model=str(target), prompt=ids, temperature=0,
                                               max_tokens=MAX_NEW_TOKENS).choices[0].text
                     for ids in prompts(vocab)]
        assert texts == expected
        assert follower.wait(timeout=120) == 0, (tmp_path / "rank1.log").read_text()[-4000:]
    finally:
        follower.kill()


def test_engine_across_two_processes_matches_tp1(tmp_path):
    target, _ = write_tp_checkpoints(tmp_path, "llama")
    address = f"127.0.0.1:{free_port()}"
    worker = [sys.executable, "-m", "sgl_jax.testing.parallel", "--model-path", str(target),
              "--tp-sizes", "4", "--nnodes", "2", "--dist-init-addr", address]
    follower = start_follower([*worker, "--node-rank", "1", "--out", str(tmp_path / "f")],
                              tmp_path / "rank1.log")
    try:
        leader = run_subprocess(worker[3:] + ["--node-rank", "0"], devices=2)["plain"]
        tp1 = run_subprocess(["--model-path", str(target), "--tp-sizes", "1"], devices=1)["plain"]
        assert leader[4]["devices"] == 4
        assert leader[4]["output_ids"] == tp1[1]["output_ids"] == transformers_greedy(target)
        assert follower.wait(timeout=120) == 0, (tmp_path / "rank1.log").read_text()[-4000:]
    finally:
        follower.kill()

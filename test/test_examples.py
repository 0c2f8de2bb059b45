"""The runnable examples in python/ and the README's promises."""

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from sgl_jax.testing.server import launch_server

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"^(python3 -m venv .*)$", (ROOT / "README.md").read_text(), re.M)


def test_offline_engine_example_runs_on_the_demo_model(tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    result = subprocess.run(
        [sys.executable, str(ROOT / "python" / "offline_engine.py"), "--max-new-tokens", "4"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("4 tokens, finish: {'type': 'length', 'length': 4}") == 2
    assert (tmp_path / "sgl-jax").is_dir()  # the demo model was written to the user cache


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    command = next(line for line in ci_lines if "pytest" in line)
    assert len(readme_commands()) == 2
    assert command == readme_commands()[1]


def test_readme_server_command_curl_line_and_openai_example(tmp_path):
    """The README's first command (after its install step) serves the demo model; its curl
    line gets a chat completion; python/openai_client.py talks to it plain and streamed."""
    launch = readme_commands()[0].split(" && ")[-1]
    assert launch == "python -m sgl_jax.launch_server"
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    with launch_server(shlex.split(launch)[3:], env=env) as server:
        assert "serving the built-in demo model" in server.log()
        port = server.base_url.rsplit(":", 1)[1]
        curl = re.search(r"^(curl .*)$", (ROOT / "README.md").read_text(), re.M).group(1)
        curl = curl.replace("127.0.0.1:30000", f"127.0.0.1:{port}")
        reply = json.loads(_run_curl(curl))
        assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] > 0
        assert "Paris" in reply["choices"][0]["message"]["content"]  # a real model answers
        result = subprocess.run(
            [sys.executable, str(ROOT / "python" / "openai_client.py"), "--base-url",
             f"{server.base_url}/v1", "--max-tokens", "6"],
            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    lines = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
             for line in result.stdout.splitlines() if line.startswith(("plain:", "streamed:"))}
    assert ast.literal_eval(lines["plain"]) == ast.literal_eval(lines["streamed"])
    assert "model: SmolLM2-135M-Instruct" in result.stdout


def readme_eagle3_demo_args() -> list[str]:
    """The flags of the README's EAGLE3 demo command (the one without --model-path)."""
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        command = shlex.split(block.replace("\\\n", " "))
        if command[:3] == ["python", "-m", "sgl_jax.launch_server"] and \
                "EAGLE3" in command and "--model-path" not in command:
            return command[3:]
    raise AssertionError("README.md has no EAGLE3 demo command")


def test_readme_eagle3_demo_server_answers_within_the_mapping_budget():
    """The README's EAGLE3 demo command (no draft path: the demo ships its head) answers a
    chat, and once warmed up holds under 16,000 memory mappings: XLA:CPU maps every compiled
    kernel into the process apart and a process may have 65,530 (docs/benchmarks/cpu.md)."""
    args = readme_eagle3_demo_args()
    assert "--speculative-draft-model-path" not in args
    with launch_server(args, timeout_s=900) as server:
        warmed = _mappings(server.process.pid)
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=300, json={
            "model": "default", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        served = _mappings(server.process.pid)
        assert "using the demo model's trained EAGLE3 head" in server.log()
    assert reply.status_code == 200 and "Paris" in reply.json()["choices"][0]["message"]["content"]
    assert warmed < 16_000 and served < 16_000, (warmed, served)


def _mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps", "rb") as maps:
        return sum(1 for _ in maps)


def test_openai_example_says_how_to_install_openai():
    hide_openai = ("import sys, runpy; sys.modules['openai'] = None; "
                   f"runpy.run_path({str(ROOT / 'python' / 'openai_client.py')!r}, "
                   "run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", hide_openai], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "needs the openai package" in result.stderr and "pip install openai" in result.stderr


def _run_curl(command: str) -> str:
    """The README's curl line as written; without curl, the same request through httpx."""
    if shutil.which("curl"):
        return subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=120,
                              check=True).stdout
    argv = shlex.split(command)
    url = next(a for a in argv if a.startswith("http"))
    return httpx.post(url, content=argv[argv.index("-d") + 1],
                      headers={"Content-Type": "application/json"}, timeout=120).text

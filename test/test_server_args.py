"""ServerArgs and its command line: every command of the seed documents parses, bad values are
refused with the setting's name, and --help documents every flag in groups."""

import argparse
import logging
import shlex
import subprocess
import sys

import pytest

from sgl_jax import launch_server
from sgl_jax.layers.attention import resolve_attention_backend
from sgl_jax.server_args import ServerArgs, build_parser

# The launch commands users copy from the model cards and the server page (flags only).
SEED_COMMANDS = [
    "--model Qwen/Qwen3-32B --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path thoughtworks/Qwen3-32B-Eagle3 --speculative-num-steps 5 "
    "--speculative-eagle-topk 4 --dtype bfloat16",
    "--model Qwen/Qwen3-32B --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path thoughtworks/Qwen3-32B-Eagle3 --speculative-num-steps 5 "
    "--speculative-eagle-topk 4 --dtype bfloat16 --chat-template qwen3-instruct-no-thinking",
    "--model-path Qwen/Qwen3-32B --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path thoughtworks/Qwen3-32B-Eagle3 --speculative-eagle-topk 1 "
    "--speculative-num-steps 3 --speculative-num-draft-tokens 4 --tp-size 8 --dtype bfloat16",
    "--model-path Qwen/Qwen2.5-7B-Instruct --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path thoughtworks/Qwen2.5-7B-Instruct-Eagle3 "
    "--speculative-eagle-topk 1 --speculative-num-steps 3 --speculative-num-draft-tokens 4 "
    "--tp-size 4 --dtype bfloat16",
    "--model-path Qwen/Qwen3-Coder-Next --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path thoughtworks/Qwen3-Coder-Next-Eagle3 "
    "--speculative-num-steps 3 --speculative-num-draft-tokens 8 --speculative-eagle-topk 4 "
    "--tp 4 --trust-remote-code --attention-backend triton --port 30000",
    "--model-path Qwen/Qwen3-Coder-Next --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path thoughtworks/Qwen3-Coder-Next-Eagle3 "
    "--speculative-num-steps 5 --speculative-num-draft-tokens 6 --speculative-eagle-topk 1 "
    "--tp 4 --trust-remote-code --attention-backend triton --port 30002",
    "--model meta-llama/Llama-3.1-8B-Instruct --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path thoughtworks/Llama-3.1-8B-Instruct-Eagle3 "
    "--speculative-num-steps 5 --speculative-eagle-topk 4 --dtype bfloat16",
    "--model-path Qwen/Qwen3-32B --trust-remote-code --device=tpu --mem-fraction-static=0.8 "
    "--max-prefill-tokens=4096 --max-running-requests=16 --decode-log-interval=1 "
    "--attention-backend=fa --dtype=bfloat16 --port 30000 --host 0.0.0.0 "
    "--disable-overlap-schedule --tp-size 4 --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path AngelSlim/Qwen3-32B_eagle3 "
    "--speculative-draft-model-revision 67caf31f9062d7ab64872e0a111d499bc16cd205 "
    "--page-size 64 --speculative-eagle-topk 1 --speculative-num-steps 3 "
    "--speculative-num-draft-tokens 4",
]


@pytest.mark.parametrize("command", SEED_COMMANDS)
def test_every_seed_command_parses(command):
    args = ServerArgs.from_cli(shlex.split(command))
    argv = shlex.split(command)
    assert args.model_path == argv[argv.index("--model" if "--model" in argv
                                              else "--model-path") + 1]
    spec = args.speculative
    assert spec.algorithm == "EAGLE3" and spec.draft_model_path.startswith(("thoughtworks/",
                                                                            "AngelSlim/"))
    if "--speculative-num-draft-tokens" in argv:
        assert spec.num_draft_tokens == int(argv[argv.index("--speculative-num-draft-tokens")
                                                 + 1])


def test_seed_server_page_command_values():
    args = ServerArgs.from_cli(shlex.split(SEED_COMMANDS[-1]))
    assert (args.device, args.mem_fraction_static, args.max_prefill_tokens) == ("tpu", 0.8, 4096)
    assert (args.max_running_requests, args.decode_log_interval, args.page_size) == (16, 1, 64)
    assert (args.host, args.port, args.tp_size, args.attention_backend) == ("0.0.0.0", 30000, 4,
                                                                            "fa")
    assert args.disable_overlap_schedule and args.trust_remote_code
    assert args.speculative.draft_model_revision == "67caf31f9062d7ab64872e0a111d499bc16cd205"
    assert args.speculative.accept_threshold_single == 1.0


def test_aliases_and_defaults():
    args = ServerArgs.from_cli(["--model", "m", "--tp", "2"])
    assert (args.model_path, args.tp_size) == ("m", 2)
    defaults = ServerArgs.from_cli([])
    assert (defaults.host, defaults.port, defaults.model_path) == ("127.0.0.1", 30000, None)
    assert defaults.speculative is None and defaults.http.served_model_name == "default"
    assert ServerArgs.from_cli(["--model-path", "org/m"]).http.served_model_name == "org/m"


def test_speculative_defaults_chain_and_tree():
    chain = ServerArgs(speculative_algorithm="eagle3", speculative_draft_model_path="d")
    assert (chain.speculative.algorithm, chain.speculative.num_steps) == ("EAGLE3", 3)
    assert (chain.speculative.eagle_topk, chain.speculative.num_draft_tokens) == (1, 4)
    tree = ServerArgs(speculative_algorithm="EAGLE3", speculative_draft_model_path="d",
                      speculative_num_steps=3, speculative_eagle_topk=4)
    assert tree.speculative.num_draft_tokens == 8


def test_nextn_reads_the_targets_own_checkpoint_unless_given_a_path():
    """The seed's NEXTN command: 3/1/4, no draft path (the MTP module is in the target's)."""
    args = ServerArgs.from_cli(["--model-path", "m", "--speculative-algorithm", "NEXTN",
                                "--speculative-num-steps", "3", "--speculative-eagle-topk",
                                "1", "--speculative-num-draft-tokens", "4"])
    spec = args.speculative
    assert (spec.algorithm, spec.draft_model_path, spec.num_draft_tokens) == ("NEXTN", "m", 4)
    other = ServerArgs(model_path="m", speculative_algorithm="nextn",
                       speculative_draft_model_path="mtp-dir")
    assert other.speculative.draft_model_path == "mtp-dir"


@pytest.mark.parametrize("algorithm", ["DFLASH", "DSPARK", "NEXTN"])
def test_a_chain_width_given_alone_sets_the_depth(algorithm):
    """SGLang's DFlash flags: `--speculative-num-draft-tokens 8` alone is a chain of 7 drafts;
    a depth given beside it must still agree, and EAGLE3 keeps its default depth."""
    argv = ["--model-path", "m", "--speculative-draft-model-path", "d",
            "--speculative-algorithm", algorithm, "--speculative-num-draft-tokens", "8"]
    spec = ServerArgs.from_cli(argv).speculative
    assert (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens) == (7, 1, 8)
    with pytest.raises(ValueError, match=r"must be num_steps \+ 1 = 4"):
        ServerArgs.from_cli([*argv, "--speculative-num-steps", "3"])
    with pytest.raises(ValueError, match=r"must be num_steps \+ 1 = 4"):
        ServerArgs.from_cli([*argv[:4], "--speculative-algorithm", "EAGLE3",
                             "--speculative-num-draft-tokens", "8"])


def test_per_request_lengths_need_the_adaptive_policy():
    argv = ["--model-path", "m", "--speculative-algorithm", "DSPARK",
            "--speculative-draft-model-path", "d", "--speculative-per-request-lengths"]
    assert ServerArgs.from_cli(argv).speculative.per_request_lengths
    assert not ServerArgs.from_cli(argv[:-1]).speculative.per_request_lengths
    with pytest.raises(ValueError, match="drop --no-speculative-adaptive"):
        ServerArgs.from_cli([*argv, "--no-speculative-adaptive"])


def test_the_demo_model_takes_eagle3_without_a_draft_path():
    """README's demo command: the demo model ships its own head (the Engine fills it in)."""
    args = ServerArgs.from_cli(["--speculative-algorithm", "EAGLE3", "--speculative-num-steps",
                                "3", "--speculative-eagle-topk", "4"])
    assert args.model_path is None and args.speculative_draft_model_path is None
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        ServerArgs.from_cli(["--speculative-algorithm", "EAGLE"])  # no demo head of that kind


@pytest.mark.parametrize("argv, message", [
    (["--model-path", "m", "--speculative-algorithm", "EAGLE3"],
     "needs --speculative-draft-model-path"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
      "--speculative-eagle-topk", "1", "--speculative-num-steps", "3",
      "--speculative-num-draft-tokens", "6"], "must be num_steps + 1 = 4"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
      "--speculative-eagle-topk", "2", "--speculative-num-steps", "2",
      "--speculative-num-draft-tokens", "9"], "in [2, 7]"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
      "--speculative-accept-threshold-acc", "1.5"], "speculative_accept_threshold_acc"),
    (["--page-size", "0"], "page_size must be >= 1"),
    (["--tp-size", "0"], "tp_size must be >= 1"),
    (["--port", "70000"], "port must be in"),
    (["--precompile-token-paddings", "64,100"], "multiples of 16"),
    (["--api-key", ""], "api_key must not be empty"),
    (["--nnodes", "2"], "--nnodes 2 needs --dist-init-addr HOST:PORT"),
    (["--nnodes", "2", "--dist-init-addr", "10.0.0.1"], "needs --dist-init-addr HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "node_rank must be in"),
    (["--nnodes", "0"], "nnodes must be >= 1"),
])
def test_invalid_values_name_the_setting(argv, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("+", r"\+")):
        ServerArgs.from_cli(argv)


@pytest.mark.parametrize("argv", [["--dtype", "int8"], ["--speculative-algorithm", "MEDUSA"],
                                  ["--attention-backend", "flashinfer"], ["--no-such-flag"],
                                  ["--spec", "EAGLE3"], ["--page-size", "x"]])
def test_the_parser_refuses_unknown_flags_and_choices(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ServerArgs.from_cli(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_help_groups_and_documents_every_flag():
    parser = build_parser()
    help_text = parser.format_help()
    groups = [g for g in parser._action_groups if g.title not in ("options",
                                                                  "positional arguments")]
    assert len(groups) >= 6
    for group in groups:
        assert group.title in help_text
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{action.option_strings} has no help"
    flags = {flag for action in parser._actions for flag in action.option_strings}
    every_seed_flag = {arg.split("=")[0] for command in SEED_COMMANDS
                       for arg in shlex.split(command) if arg.startswith("--")}
    assert every_seed_flag <= flags
    issue_flags = {"--served-model-name", "--api-key", "--context-length",
                   "--chunked-prefill-size", "--disable-radix-cache", "--enable-metrics",
                   "--log-level", "--random-seed", "--reasoning-parser", "--tool-call-parser"}
    assert issue_flags <= flags
    # Every flag is a ServerArgs field: nothing parsed is dropped.
    assert {a.dest for a in parser._actions if a.dest != "help"} <= set(
        ServerArgs.__dataclass_fields__)


@pytest.mark.parametrize("extra, message", [
    (["--tp-size", "4"], "--tp-size 4 needs 4 devices, but JAX sees 1 cpu device(s)"),
])
def test_launch_refuses_unavailable_features_before_loading(extra, message, caplog, tmp_path):
    caplog.set_level(logging.ERROR)
    missing_model = str(tmp_path / "never-read")
    assert launch_server.main(["--model-path", missing_model, *extra]) == 2
    assert message in caplog.text


def test_launch_refuses_a_device_jax_cannot_start(tmp_path):
    # A subprocess: choosing a JAX platform is process-wide.
    result = subprocess.run(
        [sys.executable, "-m", "sgl_jax.launch_server", "--model-path", str(tmp_path),
         "--device", "tpu"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "--device tpu: JAX cannot start that platform here" in result.stderr
    assert "Traceback" not in result.stderr


def test_api_key_is_hidden_in_server_info():
    assert ServerArgs(api_key="secret").to_dict()["api_key"] == "<set>"


def test_launch_refuses_an_unknown_chat_template_before_loading(caplog, tmp_path):
    caplog.set_level(logging.ERROR)
    argv = ["--model-path", str(tmp_path / "never-read"), "--chat-template", "no-such"]
    assert launch_server.main(argv) == 2
    assert "neither a file nor a built-in name" in caplog.text


def test_attention_backend_defaults_to_the_kernels_on_accelerators():
    assert ServerArgs().attention_backend is None
    assert resolve_attention_backend(None, platform="cpu") == "native"
    assert resolve_attention_backend(None, platform="tpu") == "fa"
    assert resolve_attention_backend(None, platform="gpu") == "fa"
    assert resolve_attention_backend("triton") == "fa"  # SGLang's GPU spelling
    assert resolve_attention_backend("native", platform="gpu") == "native"

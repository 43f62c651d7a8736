"""`fastdpo env`: versions, GPUs, NCCL variables, and the NCCL_P2P_DISABLE / NCCL_IB_DISABLE advice."""

import json

from fastdpo.cli import main
from fastdpo.observe.envinfo import collect, compile_vars, nccl_advice, node_count

NVLINK = [{"index": i, "name": "NVIDIA H200", "peer_access": [j for j in range(8) if j != i]} for i in range(8)]
SPLIT = [{"index": i, "name": "NVIDIA A100", "peer_access": [j for j in range(4) if j != i and j // 2 == i // 2]}
         for i in range(4)]
RTX = [{"index": i, "name": "NVIDIA GeForce RTX 4090", "peer_access": []} for i in range(2)]


def test_node_count_from_launch_variables():
    assert node_count({}) == 1
    assert node_count({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == 2
    assert node_count({"NNODES": "1:4"}) == 4


def test_ib_disabled_on_a_multi_node_launch_is_flagged():
    advice = nccl_advice({"NCCL_IB_DISABLE": "1"}, NVLINK, infiniband=True, nodes=2)
    assert any("NCCL_IB_DISABLE=1 on a 2-node launch" in a and "Unset it" in a for a in advice)


def test_p2p_disabled_with_full_peer_access_is_flagged():
    advice = nccl_advice({"NCCL_P2P_DISABLE": "1"}, NVLINK, infiniband=False, nodes=1)
    assert len(advice) == 1 and "slows communication" in advice[0]


def test_missing_peer_access_and_consumer_cards_suggest_p2p_disable():
    assert any("set NCCL_P2P_DISABLE=1" in a for a in nccl_advice({}, SPLIT, infiniband=False, nodes=1))
    assert any("Consumer GPUs" in a for a in nccl_advice({}, RTX, infiniband=False, nodes=1))
    assert nccl_advice({"NCCL_P2P_DISABLE": "1"}, RTX, infiniband=False, nodes=1) == [
        "These NCCL settings fit this machine and launch."]


def test_single_node_defaults_say_leave_them_unset():
    advice = nccl_advice({}, NVLINK, infiniband=True, nodes=1)
    assert advice == ["Single node: leave NCCL_P2P_DISABLE and NCCL_IB_DISABLE unset unless NCCL reports an error."]
    off = nccl_advice({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, NVLINK, infiniband=True, nodes=1)
    assert any("will never raise" in a for a in off)
    assert any("changes nothing here" in a for a in nccl_advice({"NCCL_IB_DISABLE": "1"}, SPLIT, False, 1))


def test_collect_and_cli(capsys, restore_logging):
    info = collect({"NCCL_DEBUG": "INFO", "WORLD_SIZE": "1", "PATH": "/bin"})
    assert info["packages"]["torch"] and info["nccl_env"] == {"NCCL_DEBUG": "INFO"}
    assert info["launch_env"] == {"WORLD_SIZE": "1"} and isinstance(info["advice"], list)
    assert main(["env", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["fastdpo"] and "torch" in printed["packages"] and "gpus" in printed
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for needle in ("torch", "transformers", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "CUDA_VISIBLE_DEVICES"):
        assert needle in out, needle


def test_compile_variables_are_collected_and_shown(capsys, restore_logging, monkeypatch):
    env = {"TORCHINDUCTOR_CPP_WRAPPER": "1", "TORCHDYNAMO_VERBOSE": "1", "TORCH_COMPILE_DEBUG": "0",
           "TORCH_LOGS": "recompiles", "NCCL_DEBUG": "INFO",
           "TORCHINDUCTOR_CACHE_DIR": "/tmp/cache"}
    assert list(compile_vars(env)) == ["TORCHDYNAMO_VERBOSE", "TORCHINDUCTOR_CPP_WRAPPER", "TORCH_COMPILE_DEBUG"]
    assert collect(env)["compile_env"] == compile_vars(env)
    monkeypatch.setenv("TORCHINDUCTOR_CPP_WRAPPER", "1")
    assert main(["env"]) == 0
    assert "TORCHINDUCTOR_CPP_WRAPPER=1" in capsys.readouterr().out
    monkeypatch.delenv("TORCHINDUCTOR_CPP_WRAPPER")
    for k in list(compile_vars()):
        monkeypatch.delenv(k)
    assert main(["env"]) == 0
    assert "torch.compile variables: none set" in capsys.readouterr().out

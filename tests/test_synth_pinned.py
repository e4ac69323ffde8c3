"""make-model's bytes, pinned: the sha256 of a file per architecture and per writing path (F32, Q8_0,
BF16, F16, directly written Q4_K and MXFP4 experts, fused experts, tied heads, MTP blocks with
``--mtp-agreement``, deepseek2's split and unsplit MLA tensors, softmax gating, no q_lora).

Why: every byte follows from the options (p2pswarm.model.synth), and models made once are compared
against runs made later; a refactor of the writer must not move a byte. If a change is *meant* to
change the bytes, bump ``SYNTH_VERSION`` (synth_presets.py) and re-pin these hashes. Recorded on
the code before issue 42's step 4 (the preset protocol) and unchanged by it."""
from __future__ import annotations

from pathlib import Path

import pytest

from p2pswarm.model.synth import make_model
from p2pswarm.model.synth_presets import SYNTH_VERSION
from p2pswarm.model.vocab import sha256_file

CASES: dict[str, tuple[dict, str]] = {
    "qwen3moe-tiny-f32": (
        dict(arch="qwen3moe", preset="tiny"),
        "eb309ff9465e867d47b4211cf3457944708dfbb203f1b54b2522fb463511309f"),
    "qwen3moe-tiny-q8-q4k": (
        dict(arch="qwen3moe", preset="tiny", qtype="q8_0", expert_qtype="q4_k", layers=2, seed=3),
        "9e5013286a1946f51beb3461c342d7734e4d875d9448e9395dffe7c1beb32c0e"),
    "qwen3moe-geom122b-small": (
        dict(arch="qwen3moe", preset="geometry-122b", layers=1, n_expert=8, router_near_tie=True),
        "770dcae520900d1ee7e3ed2219251ec6e15fb66eaa7d29710a99aeecd8077d37"),
    "qwen35moe-tiny-fused-mtp": (
        dict(arch="qwen35moe", preset="tiny", fused_experts=True, mtp_agreement=0.9),
        "a2301f5912952ebed252b3ff9c925681a3a8ed6844956ec8a86ba007357a56f4"),
    "qwen35moe-tiny-f16-tied": (
        dict(arch="qwen35moe", preset="tiny", qtype="f16", tied=True, n_nextn=1),
        "64a4aa4ee5c3165182d0447ec9f44316ee5fba65077e213b1ae39828fcfc1686"),
    "glm4moe-tiny": (
        dict(arch="glm4moe", preset="tiny"),
        "d3d68fcc99a545673f1015d0fcc8963a196057c222e29a7556854f35b5695f8c"),
    "glm4moe-tiny-mtp-q8": (
        dict(arch="glm4moe", preset="tiny", qtype="q8_0", mtp_agreement=0.5, layers=2),
        "334e418f6e2c6a7b0334b7aff46ddce2962db338a6e65824776c26688b063b1a"),
    "gptoss-tiny-mxfp4": (
        dict(arch="gpt-oss", preset="tiny", expert_qtype="mxfp4", sliding_window=16),
        "17da33402578f00e422cb93de18417436995da0a7c83dce13bd9d84eceda1050"),
    "gptoss-tiny-bf16": (
        dict(arch="gpt-oss", preset="tiny", qtype="bf16"),
        "56e44da46b030e37740fcde9843c56d1b49e220ba830fe4486468d7e22b5359f"),
    "deepseek2-tiny-split-mtp": (
        dict(arch="deepseek2", preset="tiny", mtp_agreement=0.8),
        "ec5e4d9db61d57cd30e754ec7f2829cc8082747a9f155071b6dd91260456cde1"),
    "deepseek2-tiny-unsplit-q8": (
        dict(arch="deepseek2", preset="tiny", qtype="q8_0", layers=2,
             options={"mla_split": False, "q_lora_rank": 0, "gating": "softmax"}),
        "ad4247060bd39abd4c9fa987dedd7f8fd325cd1cf4076240e12b5f7b8ea98981"),
    "deepseek2-tiny-nextn-q4k": (
        dict(arch="deepseek2", preset="tiny", qtype="q8_0", expert_qtype="q4_k", n_nextn=1),
        "777e3d54ecd83a9626231cfc5a099988bae9857e6a0c41c0378a306afe6b69b9"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_make_model_bytes_are_pinned(tmp_path: Path, name: str) -> None:
    options, digest = CASES[name]
    assert SYNTH_VERSION == 1, "SYNTH_VERSION changed: re-pin the hashes below it"
    path = make_model(tmp_path / f"{name}.gguf", **options)
    assert sha256_file(path) == digest, f"{name}: make-model wrote other bytes than before"

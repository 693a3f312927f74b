"""Sources: the deterministic demo, local paths, and hub repos read offline from the cache."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from packer.demo import write_demo
from packer.errors import SourceError
from packer.recipe import recipe_from_dict
from packer.source import hf_allow_patterns, parse_hf_uri, resolve_source
from tests.hf_cache import populate_cache

DEMO_FILES = {"pytorch_model.bin", "config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json"}


def _recipe(source: str, base: Path = Path("."), **sections: object):
    return recipe_from_dict({"name": "m", "version": "1", "source": source, **sections}, base_dir=base)


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir()}


def test_demo_is_deterministic_and_torch_reads_it(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    write_demo(a), write_demo(b)
    assert set(_digests(a)) == DEMO_FILES
    assert _digests(a) == _digests(b)
    size = (a / "pytorch_model.bin").stat().st_size
    assert 20e6 < size < 60e6  # "a few tens of MB"
    torch = pytest.importorskip("torch")
    sd = torch.load(a / "pytorch_model.bin", weights_only=True, mmap=True)  # oracle only
    emb, head = sd["model.embed_tokens.weight"], sd["lm_head.weight"]
    assert emb.dtype == torch.bfloat16 and emb.shape == (8192, 512)
    assert emb.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()  # tied
    assert torch.isfinite(emb.float()).all()


def test_demo_tokenizer_loads(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    write_demo(tmp_path)
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.encode("hello baba").ids[1] != 0


def test_demo_source_is_temporary() -> None:
    with resolve_source(_recipe("demo")) as snap:
        assert snap.kind == "demo" and (snap.root / "pytorch_model.bin").is_file()
        root = snap.root
    assert not root.exists()


def test_local_dir_and_file(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "w.pt").write_bytes(b"x")
    with resolve_source(_recipe("m", tmp_path)) as snap:
        assert snap.root == tmp_path / "m" and not snap.single_file and snap.identity()["uri"] == "m"
    with resolve_source(_recipe("m/w.pt", tmp_path)) as snap:
        assert snap.single_file and snap.weights == tmp_path / "m" / "w.pt"


def test_missing_local_source(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="'nope': .*does not exist"), resolve_source(_recipe("nope", tmp_path)):
        pass


@pytest.mark.parametrize("uri", ["hf://", "hf://a/b/c@x", "hf://org/name"])
def test_bad_hf_uris(uri: str) -> None:
    with pytest.raises(SourceError, match="hf://"):
        parse_hf_uri(uri)


def test_hf_offline_from_cache(tmp_path: Path) -> None:
    snap_dir = populate_cache(tmp_path, "acme/tiny", {"config.json": b"{}", "sub/x.txt": b"x"})
    with resolve_source(_recipe("hf://acme/tiny@main"), cache_dir=tmp_path) as snap:
        assert snap.kind == "hf" and snap.root == snap_dir
        assert snap.revision == "0123456789abcdef0123456789abcdef01234567"  # resolved commit
        assert snap.allowed_root == tmp_path / "models--acme--tiny"
        assert (snap.root / "config.json").read_bytes() == b"{}"


def test_hf_offline_missing_revision_is_one_clear_line(tmp_path: Path) -> None:
    populate_cache(tmp_path, "acme/tiny", {"config.json": b"{}"})
    with pytest.raises(SourceError, match="not in the local cache.*HF_HUB_OFFLINE"), \
            resolve_source(_recipe("hf://acme/tiny@v9"), cache_dir=tmp_path):
        pass


def test_allow_patterns_follow_the_recipe() -> None:
    r = _recipe("hf://a/b@main", weights={"files": ["*.bin"]}, bundle={"include": ["tok*.json"]})
    assert hf_allow_patterns(r) == ["*.bin", "tok*.json"]
    assert "*.safetensors" in hf_allow_patterns(_recipe("hf://a/b@main"))

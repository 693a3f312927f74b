"""The embedded demo: a deterministic tiny llama-style model that packer writes itself.

``packer build`` with no recipe converts this model, so the main job runs on a fresh machine
with no network. The checkpoint is a torch zip-format pickle (what ``torch.save`` writes) of
bfloat16 weights with tied input/output embeddings, written by this module without torch,
byte for byte the same every time. Beside it: config.json, generation_config.json and a
working WordLevel tokenizer (tokenizer.json, tokenizer_config.json, special_tokens_map.json).
"""

from __future__ import annotations

import itertools
import json
import random
import struct
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from packer.errors import PackerError, UsageError
from packer.util.fsutil import atomic_open, atomic_write_bytes, remove_tree
from packer.util.show import shell_word

ARCHIVE = "pytorch_model"  # the top directory inside the zip, as torch names it
_ALIGN = 64  # torch aligns storage entries to 64 bytes so they can be mmapped


@dataclass(frozen=True)
class DemoShape:
    """Dimensions of the demo model (about 32 MB of bfloat16 weights)."""

    vocab: int = 8192
    hidden: int = 512
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1376


def _tensor_shapes(s: DemoShape) -> list[tuple[str, tuple[int, ...]]]:
    head_dim = s.hidden // s.heads
    kv = s.kv_heads * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (s.hidden,)),
            (p + "self_attn.q_proj.weight", (s.hidden, s.hidden)),
            (p + "self_attn.k_proj.weight", (kv, s.hidden)),
            (p + "self_attn.v_proj.weight", (kv, s.hidden)),
            (p + "self_attn.o_proj.weight", (s.hidden, s.hidden)),
            (p + "post_attention_layernorm.weight", (s.hidden,)),
            (p + "mlp.gate_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.up_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.down_proj.weight", (s.hidden, s.intermediate)),
        ]
    shapes.append(("model.norm.weight", (s.hidden,)))
    return shapes


# bf16 high byte: keep the random sign bit, fix the exponent's top bits so |x| lies in
# [2**-7, 2**-5): small finite weights, never NaN or inf.
_HIGH = bytes(0x3C | (b & 0x80) for b in range(256))
_ONE_BF16 = b"\x80\x3f"


def _bf16_bytes(rng: random.Random, numel: int, *, ones: bool) -> bytes:
    if ones:  # norm weights start at 1.0, as in a freshly initialised llama
        return _ONE_BF16 * numel
    out = bytearray(2 * numel)
    out[0::2] = rng.randbytes(numel)
    out[1::2] = rng.randbytes(numel).translate(_HIGH)
    return bytes(out)


class _PickleWriter:
    """Emits the protocol-2 opcodes torch.save writes for a dict of tensors."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")

    def _str(self, s: str) -> None:
        raw = s.encode()
        self.out += b"X" + struct.pack("<I", len(raw)) + raw

    def _int(self, v: int) -> None:
        if 0 <= v < 256:
            self.out += b"K" + bytes([v])
        elif 0 <= v < 65536:
            self.out += b"M" + struct.pack("<H", v)
        else:
            self.out += b"J" + struct.pack("<i", v)

    def _ints(self, values: tuple[int, ...]) -> None:
        self.out += b"("
        for v in values:
            self._int(v)
        self.out += b"t"

    def _global(self, module: str, name: str) -> None:
        self.out += f"c{module}\n{name}\n".encode()

    def tensor(self, key: str, shape: tuple[int, ...]) -> None:
        stride = tuple(itertools.accumulate((1, *shape[:0:-1]), lambda a, b: a * b))[::-1]
        numel = 1
        for d in shape:
            numel *= d
        self._global("torch._utils", "_rebuild_tensor_v2")
        self.out += b"(("
        self._str("storage")
        self._global("torch", "BFloat16Storage")
        self._str(key)
        self._str("cpu")
        self._int(numel)
        self.out += b"tQ"  # persistent id tuple -> BINPERSID
        self._int(0)  # storage offset
        self._ints(shape)
        self._ints(stride)
        self.out += b"\x89"  # requires_grad = False
        self._global("collections", "OrderedDict")
        self.out += b")Rt"  # empty backward hooks, close the args tuple
        self.out += b"R"

    def state_dict(self, entries: list[tuple[str, str, tuple[int, ...]]]) -> bytes:
        self._global("collections", "OrderedDict")
        self.out += b")R("
        for name, key, shape in entries:
            self._str(name)
            self.tensor(key, shape)
        self.out += b"u."
        return bytes(self.out)


def _zip_member(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(f"{ARCHIVE}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    # Pad the local header's extra field so the data starts on a 64-byte boundary.
    start = zf.fp.tell() + 30 + len(info.filename.encode())  # type: ignore[union-attr]
    pad = (-(start + 4)) % _ALIGN
    info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
    zf.writestr(info, data)


def _checkpoint_members(shape: DemoShape) -> Iterator[tuple[str, bytes]]:
    rng = random.Random(20261129)
    entries = []
    storages: list[tuple[str, bytes]] = []
    for i, (name, dims) in enumerate(_tensor_shapes(shape)):
        numel = 1
        for d in dims:
            numel *= d
        storages.append((str(i), _bf16_bytes(rng, numel, ones=len(dims) == 1)))
        entries.append((name, str(i), dims))
    # Tied output embedding: the same storage, shape and stride as the input embedding.
    entries.append(("lm_head.weight", "0", (shape.vocab, shape.hidden)))
    yield "data.pkl", _PickleWriter().state_dict(sorted(entries))
    yield "byteorder", b"little"
    for key, data in storages:
        yield f"data/{key}", data
    yield "version", b"3\n"


def _tokenizer_json(shape: DemoShape) -> dict[str, object]:
    specials = ["<unk>", "<s>", "</s>"]
    chars = [chr(c) for c in range(33, 127)]
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    words = (a + b for a, b in itertools.product(syllables, repeat=2))
    vocab_list = specials + chars + list(itertools.islice(words, shape.vocab - len(specials) - len(chars)))
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, t in enumerate(specials)
        ],
        "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(vocab_list)}, "unk_token": "<unk>"},
    }


def _config_files(shape: DemoShape) -> dict[str, dict[str, object]]:
    return {
        "config.json": {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": shape.vocab, "hidden_size": shape.hidden,
            "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "intermediate_size": shape.intermediate,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2,
        },
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 64},
        "tokenizer.json": _tokenizer_json(shape),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "model_max_length": 2048, "clean_up_tokenization_spaces": False,
        },
        "special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    }


def write_demo(dest: Path, shape: DemoShape = DemoShape()) -> Path:
    """Write the demo model into the existing directory ``dest`` and return it.

    Returns:
        ``dest``, now holding pytorch_model.bin and the config and tokenizer files.
    """
    with atomic_open(dest / "pytorch_model.bin") as f, zipfile.ZipFile(f, "w") as zf:
        for name, data in _checkpoint_members(shape):
            _zip_member(zf, name, data)
    for name, content in _config_files(shape).items():
        text = json.dumps(content, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        atomic_write_bytes(dest / name, text.encode())
    return dest


def write_demo_model(dest: str | Path) -> list[str]:
    """Write the demo model as a model directory a user would have (``packer demo-model DIR``).

    The same files ``packer build`` with no recipe converts (a ``torch.save`` zip pickle
    ``pytorch_model.bin``, config.json, generation_config.json and a working tokenizer), written
    to a folder of their own so that every step of the tutorial, from a recipe naming a local
    source to vLLM serving the build, runs with no hub. They go into a temporary sibling first
    and are renamed to ``dest`` whole: an interrupted call leaves no half-written model.

    Args:
        dest: the new directory; its parent must exist, ``dest`` must not (or be empty).

    Returns:
        The names of the files written, sorted.

    Raises:
        UsageError: ``dest``'s parent is missing, or ``dest`` exists and is not an empty directory.
        PackerError: nothing can be written beside ``dest``.
    """
    dest = Path(dest)
    if not dest.parent.is_dir():
        raise UsageError(f"demo-model: {dest.parent} does not exist; create it first "
                         f"(mkdir -p {shell_word(str(dest.parent))}), or name a DIR whose parent exists")
    if dest.exists() and not (dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir())):
        raise UsageError(f"demo-model: {dest} already exists; name a new directory (it is created)")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    except OSError as e:  # the temporary name means nothing to the user: the place does
        raise PackerError(f"demo-model: cannot write {dest}: {e.strerror or e}") from e
    try:
        write_demo(tmp)
        tmp.chmod(0o755)
        if dest.exists():
            dest.rmdir()  # empty, checked above
        tmp.rename(dest)
    except BaseException:
        remove_tree(tmp, ignore_errors=True)
        raise
    return sorted(p.name for p in dest.iterdir())

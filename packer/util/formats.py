"""File names, weight-file patterns and cast dtypes that the build, the image, verify and the CLI share.

One spelling of each, so that a stage cannot write under one name what another reads under
another. The emitted loader cannot import packer, so ``packer/runtime`` keeps its own copies;
the output shard names (``model.safetensors`` and its index) are the weights plan's
(:mod:`packer.weights.plan`).
"""

from __future__ import annotations

import re
from pathlib import Path

from packer.util.show import shell_word

LOADER_NAME = "packer_loader.py"  # the emitted loader, at the top of OUT and of the image's tree
MANIFEST_NAME = "manifest.json"  # the artifact manifest, beside it
# where the sandboxed weights stage leaves each weight layer blob it wrote (``<file path>``), for
# the build to hash and move to ``image/blobs/sha256/<digest>`` (packer/oci/reread.py)
UNNAMED_BLOBS = "image/unnamed"

SAFETENSORS_SUFFIX = ".safetensors"
# Weight files packer converts: safetensors, then what torch.save writes under its customary
# names. The order is the one the weights stage names them in when it finds none it expects.
BIN_SUFFIX = ".bin"  # pytorch_model.bin, diffusion_pytorch_model.bin, adapter_model.bin
WEIGHT_SUFFIXES = (SAFETENSORS_SUFFIX, ".pt", ".pth", ".ckpt", BIN_SUFFIX)
WEIGHT_PATTERNS = tuple(f"*{s}" for s in WEIGHT_SUFFIXES)

# What a source is (recipe ``weights.layout``; packer.components detects it under "auto").
LAYOUTS = ("auto", "model", "diffusers", "sentence-transformers", "peft")

# The dtypes floating tensors can be cast to (recipe ``weights.dtype``, ``convert --dtype``),
# each with its safetensors code.
CAST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}

SIGNATURE_NAME = "model.sig"  # the OpenSSF model signature (packer/runtime/signature.py: SIGNATURE_FILE)
PROVENANCE_NAME = "provenance.sigstore.json"  # the signed SLSA provenance; outside the manifest it describes

# Weight files of other frameworks that packer does not convert, by name: what each is and what
# to do. They are named (never opened) when a source holds nothing else, and in the left-out note.
_NOT_OURS = "which packer does not convert (it reads PyTorch pickles and safetensors)"
# transformers' own TensorFlow and Flax files. transformers 5 has neither framework (from_pretrained
# drops from_tf/from_flax unread), and 4.51 to 4.57 build the model on the meta device first, so
# their from_tf/from_flax copy the weights into nothing: 4.50 is the last release that converts
# them. The pins beside it are those transformers 4.x declares for each framework (numpy 2 breaks
# jaxlib 0.4.13; transformers asks TensorFlow for the legacy Keras, which tf-keras provides).
TF_PACKAGES = ("transformers<4.51", "torch", "tensorflow-cpu<2.16", "tf-keras<2.16")
FLAX_PACKAGES = ("transformers<4.51", "torch", "flax<=0.7.0", "jax[cpu]<=0.4.13", "numpy<2")
DIR = "{dir}"  # where foreign_advice() puts the source directory, as the shell reads it (show.shell_word)


def _to_pytorch(what: str, framework: str, flag: str, packages: tuple[str, ...]) -> str:
    """The advice for a transformers checkpoint of ``framework``: the PyTorch weights, written beside it."""
    pip = " ".join(shell_word(p) for p in packages)
    return (f"{what}, {_NOT_OURS}: build the PyTorch weights that the same hub repo often publishes "
            f"(model.safetensors, pytorch_model.bin), or write them beside it with transformers 4.50, the last "
            f"release that converts {framework} weights: `pip install {pip}`, then `python -c \"import sys, "
            "transformers as t; d = sys.argv[1]; getattr(t, t.AutoConfig.from_pretrained(d).architectures[0])"
            f".from_pretrained(d, {flag}=True).save_pretrained(d)\" {DIR}`")


_TF = _to_pytorch("a TensorFlow (Keras) checkpoint of transformers", "TensorFlow", "from_tf", TF_PACKAGES)
_FLAX = _to_pytorch("a Flax checkpoint of transformers", "Flax", "from_flax", FLAX_PACKAGES)
_KERAS = (f"a Keras model, {_NOT_OURS}: serve it with TensorFlow, or build a PyTorch or safetensors "
          "checkpoint of the same model")
_GGUF = ("a GGUF file (llama.cpp's format, often re-quantized), which packer does not convert: serve it "
         "with llama.cpp, or build the safetensors model it was made from")
_ONNX = ("an ONNX graph, which packer does not convert: serve it with ONNX Runtime, or build the "
         "PyTorch or safetensors model it was exported from")
_TF_GRAPH = ("a TensorFlow SavedModel, checkpoint or TFLite file, which packer does not convert: serve it with "
             "TensorFlow, or build the PyTorch or safetensors checkpoint of the same model")
_FLAX_OTHER = (f"a Flax (msgpack) checkpoint, {_NOT_OURS}: build a PyTorch or safetensors checkpoint of the "
               "same model")
FILE, BESIDE = "{file}", "{beside}"  # the file itself, and <its stem>.safetensors beside it, as the shell reads them
# NumPy's own files hold plain arrays (np.load with allow_pickle=False refuses an object array): the
# advice writes them as safetensors with the safetensors library's numpy writer, nothing unpickled.
_NUMPY_SAVE = ("`python -c \"import sys, numpy as np; from safetensors.numpy import save_file; "
               "a = np.load(sys.argv[1], allow_pickle=False); "
               "save_file({k: np.ascontiguousarray(a[k]) for k in a.files} "
               f"if hasattr(a, 'files') else {{'weight': np.ascontiguousarray(a)}}, sys.argv[2])\" {FILE} {BESIDE}`")
_NUMPY = (f"NumPy arrays ({{kind}}), {_NOT_OURS}: write them as safetensors, read with pickle refused: "
          f"{_NUMPY_SAVE}, then build {BESIDE}")
# first match wins: transformers names its TensorFlow shards tf_model-00001-of-00002.h5
FOREIGN_WEIGHTS: tuple[tuple[str, str], ...] = (
    ("tf_model*.h5", _TF), ("*.h5", _KERAS), ("*.hdf5", _KERAS), ("*.keras", _KERAS),
    ("flax_model*.msgpack", _FLAX), ("*.msgpack", _FLAX_OTHER),
    ("*.gguf", _GGUF), ("*.onnx", _ONNX),
    ("*.pb", _TF_GRAPH), ("*.tflite", _TF_GRAPH), ("*.ckpt.index", _TF_GRAPH), ("*.ckpt.data-*", _TF_GRAPH),
    ("*.npz", _NUMPY.replace("{kind}", "a .npz archive")), ("*.npy", _NUMPY.replace("{kind}", "a .npy array")),
)
# What a file's first bytes say it is, where its name does not (the same words as by name)
FOREIGN_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"GGUF", _GGUF), (b"\x89HDF\r\n\x1a\n", _KERAS), (b"\x93NUMPY", _NUMPY.replace("{kind}", "a .npy array")),
)
CTRANSLATE2 = ("a CTranslate2 model (model.bin of a {spec}), which only CTranslate2 reads and packer does not "
               "convert: serve it with CTranslate2, or build the checkpoint it was converted from (a "
               "transformers, OpenNMT or fairseq model)")


def foreign_weights(name: str) -> str | None:
    """What the weight file ``name`` of another framework is and what to do (its commands name the
    directory as ``{dir}``: :func:`foreign_advice` fills it in), or None (not one)."""
    from fnmatch import fnmatchcase

    return next((what for pattern, what in FOREIGN_WEIGHTS if fnmatchcase(name, pattern)), None)


HEAD_BYTES = 72  # the first bytes foreign_advice() reads a file by: magic numbers, CTranslate2's spec name
_SPEC = re.compile(rb"[A-Za-z][A-Za-z0-9_]{0,60}Spec")


def _ctranslate2_spec(head: bytes) -> str | None:
    """The model spec a CTranslate2 ``model.bin`` starts with (binary version, then its
    length-prefixed, NUL-ended spec name), or None."""
    if len(head) < 8:
        return None
    version, n = int.from_bytes(head[:4], "little"), int.from_bytes(head[4:6], "little")
    name = head[6:6 + n]
    if not (1 <= version <= 64 and len(name) == n and name.endswith(b"\0") and _SPEC.fullmatch(name[:-1])):
        return None
    return name[:-1].decode("ascii")


def foreign_advice(path: Path, head: bytes = b"") -> str | None:
    """The one recogniser of other frameworks' weight files (``build``, ``convert`` and ``inspect``
    all answer with it): what ``path`` is and what to do, with the commands that convert it naming
    its directory and the file (:func:`packer.util.show.shell_word`: a newline or tab in them survives
    the paste), or None (not one). By its name first (Keras, ONNX, TensorFlow, Flax, GGUF, NumPy);
    then by its first :data:`HEAD_BYTES` bytes ``head`` when given (a GGUF, HDF5 or NumPy file
    under another name, a CTranslate2 ``model.bin``)."""
    what = foreign_weights(path.name) or next((w for magic, w in FOREIGN_MAGIC if head.startswith(magic)), None)
    if what is None and (spec := _ctranslate2_spec(head)):
        what = CTRANSLATE2.format(spec=spec)
    if what is None:
        return None
    beside = path.parent / (path.name.split(".")[0] + SAFETENSORS_SUFFIX)
    return (what.replace(DIR, shell_word(str(path.parent))).replace(FILE, shell_word(str(path)))
            .replace(BESIDE, shell_word(str(beside))))

# A weight variant (``save_pretrained(variant="fp16")``): the libraries put its name before the last
# suffix (transformers' and diffusers' ``_add_variant``): model.fp16.safetensors, its shards
# model.fp16-00001-of-00002.safetensors (diffusers' older ones model-00001-of-00002.fp16.safetensors)
# and their index model.safetensors.index.fp16.json. A model published only as a variant keeps
# those names in the model directory, so that ``from_pretrained(..., variant="fp16")`` finds it.
_V = r"(?P<v>[A-Za-z0-9_]{1,32})"
_SHARD = r"-\d{5}-of-\d{5}"
_VARIANT_NAMES = (rf"\.{_V}\.(?:safetensors|bin)", rf"\.{_V}{_SHARD}\.(?:safetensors|bin)",
                  rf"{_SHARD}\.{_V}\.(?:safetensors|bin)", rf"\.(?:safetensors|bin)\.index\.{_V}\.json")


def variant_of(name: str, stems: tuple[str, ...]) -> str | None:
    """The variant in the weight file or index name ``name`` of one of ``stems``
    (``model.fp16.safetensors``, ``model.safetensors.index.fp16.json``: ``"fp16"``), or None."""
    for stem in stems:
        for tail in _VARIANT_NAMES:
            if (m := re.fullmatch(re.escape(stem) + tail, name)) and m["v"] not in ("safetensors", "bin", "index"):
                return m["v"]
    return None


def with_variant(name: str, variant: str | None) -> str:
    """``name`` (``model.safetensors``, ``model.safetensors.index.json``) as the libraries name its
    ``variant``: the variant before the last suffix (``model.fp16.safetensors``)."""
    if not variant:
        return name
    head, dot, last = name.rpartition(".")
    return f"{head}.{variant}.{last}" if dot else name

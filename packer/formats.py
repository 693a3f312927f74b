"""File names, weight-file patterns and cast dtypes that the build, the image, verify and the CLI share.

One spelling of each, so that a stage cannot write under one name what another reads under
another. The emitted loader cannot import packer, so ``packer/runtime`` keeps its own copies;
the output shard names (``model.safetensors`` and its index) are the weights plan's
(:mod:`packer.weights.plan`).
"""

from __future__ import annotations

LOADER_NAME = "packer_loader.py"  # the emitted loader, at the top of OUT and of the image's tree
MANIFEST_NAME = "manifest.json"  # the artifact manifest, beside it

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
_TF = ("a TensorFlow (Keras) checkpoint, which packer does not convert (it reads PyTorch pickles and "
       "safetensors): build the PyTorch weights instead; transformers writes them with "
       "from_pretrained(DIR, from_tf=True).save_pretrained(OUT)")
_FLAX = ("a Flax checkpoint, which packer does not convert (it reads PyTorch pickles and safetensors): "
         "build the PyTorch weights instead; transformers writes them with "
         "from_pretrained(DIR, from_flax=True).save_pretrained(OUT)")
_GGUF = ("a GGUF file (llama.cpp's format, often re-quantized), which packer does not convert: serve it "
         "with llama.cpp, or build the safetensors model it was made from")
_ONNX = ("an ONNX graph, which packer does not convert: serve it with ONNX Runtime, or build the "
         "PyTorch or safetensors model it was exported from")
FOREIGN_WEIGHTS: tuple[tuple[str, str], ...] = (
    ("*.h5", _TF), ("*.keras", _TF), ("flax_model*.msgpack", _FLAX), ("*.gguf", _GGUF), ("*.onnx", _ONNX),
)
CTRANSLATE2 = ("a CTranslate2 model (model.bin of a {spec}), which only CTranslate2 reads and packer does not "
               "convert: serve it with CTranslate2, or build the transformers model it was converted from")


def foreign_weights(name: str) -> str | None:
    """What the weight file ``name`` of another framework is and what to do, or None (not one)."""
    from fnmatch import fnmatchcase

    return next((what for pattern, what in FOREIGN_WEIGHTS if fnmatchcase(name, pattern)), None)

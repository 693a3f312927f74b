"""Signed builds: an OpenSSF model signature and a signed SLSA build provenance, from the
digests the build already has.

* :mod:`packer.sign.keys`: the signing key (PEM, EC P-256/384/521) and the key-signed
  Sigstore bundle both signatures are written as;
* :mod:`packer.sign.model_sig`: ``model.sig`` over the model directory, the statement made by
  the ``model_signing`` library from the manifest's sha256 digests (no weight is read again);
* :mod:`packer.sign.provenance`: ``provenance.sigstore.json``, an in-toto statement with a
  SLSA provenance v1 predicate whose subjects are every output by digest;
* :mod:`packer.sign.check`: what ``packer verify`` checks, with and without a public key
  (:func:`~packer.sign.check.check_signatures`, the build side's one entry point; every
  signature file, the warm state's too, is opened by :mod:`packer.signed`).

Signing needs the ``sign`` extra (``pip install 'model-packer[sign]'``: model-signing,
pyOpenSSL, cryptography); the plain install builds and verifies unsigned builds without it.
"""

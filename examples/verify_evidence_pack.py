#!/usr/bin/env python3
"""Verify a RefundOps evidence pack without RefundOps: only Python 3 and `cryptography`.

    python verify_evidence_pack.py PACK.zip --public-key evidence-key.pem.pub

Exit 0 when manifest.json's Ed25519 signature (manifest.sig) holds with the public key you were
given and every file in the ZIP is listed in it with the same SHA-256: nothing added, removed or
changed. Exit 1 naming each difference otherwise.
"""

import argparse
import base64
import hashlib
import json
import sys
import zipfile

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key

MANIFEST, SIGNATURE = "manifest.json", "manifest.sig"


def sha256_of(archive, name):
    digest = hashlib.sha256()
    with archive.open(name) as member:  # in chunks: a quarter's CSV need not fit in memory
        for chunk in iter(lambda: member.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def problems_in(pack, public_key_pem):
    public = load_pem_public_key(public_key_pem)
    if not isinstance(public, Ed25519PublicKey):
        return ["the public key is not an Ed25519 key"]
    found = []
    with zipfile.ZipFile(pack) as archive:
        names = archive.namelist()
        if len(names) != len(set(names)):
            found.append("a file name appears twice in the ZIP")
        if MANIFEST not in names or SIGNATURE not in names:
            return found + [MANIFEST + " or " + SIGNATURE + " is missing"]
        body = archive.read(MANIFEST)
        try:
            public.verify(base64.b64decode(archive.read(SIGNATURE)), body)
        except (InvalidSignature, ValueError):
            return found + ["the signature of " + MANIFEST + " does not verify with this public key"]
        listed = json.loads(body)["files"]
        for name in sorted(set(names) - set(listed) - {MANIFEST, SIGNATURE}):
            found.append(name + " was added")
        for name, digest in sorted(listed.items()):
            if name not in names:
                found.append(name + " was removed")
            elif sha256_of(archive, name) != digest:
                found.append(name + " was changed")
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--public-key", required=True, help="the Ed25519 public key (PEM) you were given")
    args = parser.parse_args()
    with open(args.public_key, "rb") as f:
        found = problems_in(args.pack, f.read())
    for problem in found:
        print(problem)
    if found:
        return 1
    with zipfile.ZipFile(args.pack) as archive:
        manifest = json.loads(archive.read(MANIFEST))
    period = manifest["period"]
    print("verifies: " + str(len(manifest["files"])) + " files as signed; period " + period["from"] + " to "
          + period["to"] + "; audit chain heads " + json.dumps(manifest["audit_chain_heads"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

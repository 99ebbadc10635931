#!/usr/bin/env python3
"""PSNR (peak 1.0) of the float32 tensor `image` of safetensors files against the first one.

Usage: psnr.py reference.safetensors other.safetensors [...]; standard library only.
"""
import array
import json
import math
import struct
import sys


def read_image(path):
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        entry = header["image"]
        if entry["dtype"] != "F32":
            sys.exit(f"{path}: tensor 'image' is {entry['dtype']}, expected F32")
        begin, end = entry["data_offsets"]
        f.seek(8 + size + begin)
        values = array.array("f")
        values.frombytes(f.read(end - begin))
        return values


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    reference = read_image(sys.argv[1])
    for path in sys.argv[2:]:
        other = read_image(path)
        if len(other) != len(reference):
            sys.exit(f"{path}: {len(other)} values, the reference has {len(reference)}")
        mse = sum((a - b) ** 2 for a, b in zip(reference, other)) / len(reference)
        worst = max(abs(a - b) for a, b in zip(reference, other))
        psnr = math.inf if mse == 0 else 10 * math.log10(1.0 / mse)
        print(f"{path}: PSNR {psnr:.2f} dB, max |diff| {worst:.4f}")


if __name__ == "__main__":
    main()

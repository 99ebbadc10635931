#!/usr/bin/env python3
"""PSNR (peak 1.0) and SSIM of the float32 tensor `image` of safetensors files against the first one.

Usage: psnr.py reference.safetensors other.safetensors [...]; standard library only. `image` is
[B, H, W, 3] in [0, 1]; with B > 1 each image of the batch is also reported on its own. SSIM is
Wang et al.'s with scikit-image's defaults (7x7 uniform windows, K1 = 0.01, K2 = 0.03, sample
covariances, data range 1), over each channel, averaged.
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
        return values, entry["shape"]


def window_means(plane, h, w, r):
    """The mean of each (2r+1)^2 window lying wholly inside the h x w plane (a summed-area table)."""
    table = [[0.0] * (w + 1) for _ in range(h + 1)]
    for y in range(h):
        row, above, here = plane[y * w:(y + 1) * w], table[y], table[y + 1]
        running = 0.0
        for x in range(w):
            running += row[x]
            here[x + 1] = above[x + 1] + running
    n = (2 * r + 1) ** 2
    return [[(table[y + r + 1][x + r + 1] - table[y - r][x + r + 1] - table[y + r + 1][x - r] + table[y - r][x - r]) / n
             for x in range(r, w - r)] for y in range(r, h - r)]


def ssim_plane(a, b, h, w, r=3):
    n = (2 * r + 1) ** 2
    cov = n / (n - 1)
    mu_a, mu_b = window_means(a, h, w, r), window_means(b, h, w, r)
    aa = window_means([v * v for v in a], h, w, r)
    bb = window_means([v * v for v in b], h, w, r)
    ab = window_means([x * y for x, y in zip(a, b)], h, w, r)
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    total, count = 0.0, 0
    for y in range(len(mu_a)):
        for x in range(len(mu_a[0])):
            ma, mb = mu_a[y][x], mu_b[y][x]
            va, vb = cov * (aa[y][x] - ma * ma), cov * (bb[y][x] - mb * mb)
            vab = cov * (ab[y][x] - ma * mb)
            total += ((2 * ma * mb + c1) * (2 * vab + c2)) / ((ma * ma + mb * mb + c1) * (va + vb + c2))
            count += 1
    return total / count


def compare(reference, other, h, w):
    mse = sum((a - b) ** 2 for a, b in zip(reference, other)) / len(reference)
    worst = max(abs(a - b) for a, b in zip(reference, other))
    psnr = math.inf if mse == 0 else 10 * math.log10(1.0 / mse)
    ssim = sum(ssim_plane(reference[c::3], other[c::3], h, w) for c in range(3)) / 3
    return psnr, ssim, worst


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    reference, shape = read_image(sys.argv[1])
    batch, h, w = shape[0], shape[1], shape[2]
    per_image = h * w * 3
    for path in sys.argv[2:]:
        other, other_shape = read_image(path)
        if other_shape != shape:
            sys.exit(f"{path}: image of shape {other_shape}, the reference has {shape}")
        for i in range(batch):
            part = slice(i * per_image, (i + 1) * per_image)
            psnr, ssim, worst = compare(reference[part], other[part], h, w)
            label = f"{path} [{i}]" if batch > 1 else path
            print(f"{label}: PSNR {psnr:.2f} dB, SSIM {ssim:.4f}, max |diff| {worst:.4f}")


if __name__ == "__main__":
    main()

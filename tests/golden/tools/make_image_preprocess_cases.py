#!/usr/bin/env python3
"""Writes the golden case `image_preprocess` with diffusers' own image processors.

A user's image as diffusers' FLUX.2 pipelines (Flux2ImageProcessor.check_image_input, the resize
to the 1024^2 area with Pillow's LANCZOS when larger, the floor to multiples of 16, the centre
crop) and FLUX.1 Kontext (the PREFERRED_KONTEXT_RESOLUTIONS entry closest in aspect, floored to
multiples of 16, VaeImageProcessor.resize with LANCZOS) prepare it for the VAE encoder. The source
images are drawn here, procedurally and from a fixed seed: smooth gradients under sharp-edged
shapes and thin stripes (what a resampling filter must get right: flat areas, edges, detail near
the Nyquist rate), which PNG packs small. Every expected image is the processed tensor as the
8-bit image it equals (checked: tensor == png / 255 * 2 - 1 exactly).

Run by hand, never by the suite (PyPI's torch and diffusers at the versions the benchmarks'
yardstick pins, bench/yardstick_venv.sh, and Pillow below):

    python3 tests/golden/tools/make_image_preprocess_cases.py --venv build/yardstick-venv \
        --out tests/golden/image_preprocess

When the running Python lacks those versions it makes the virtual environment with
bench/yardstick_venv.sh, adds Pillow, and runs itself there.
"""
import argparse
import json
import math
import os
import random
import subprocess
import sys

TORCH_VERSION = "2.15.0"  # bench/yardstick_venv.sh's pins
DIFFUSERS_VERSION = "0.42.1"
PILLOW_VERSION = "13.0.0"
NUMPY_VERSION = "2.4.6"
SEED = 20261206
# (name, height, width), the sizes each case needs: a large image (resized by FLUX.2), a small
# one of odd aspect (cropped), one Kontext enlarges, one too small and one too thin (errors).
SOURCES = [("big", 1000, 1100), ("crop", 100, 70), ("kontext", 200, 300), ("too_small", 50, 200),
           ("too_thin", 64, 600)]
CASES = [("big", "flux2"), ("crop", "flux2"), ("crop", "kontext"), ("kontext", "flux2"), ("kontext", "kontext"),
         ("too_small", "flux2"), ("too_thin", "flux2")]


def pinned_versions_present():
    try:
        import diffusers
        import numpy
        import PIL
        import torch
    except ImportError:
        return False
    return (torch.__version__.split("+")[0] == TORCH_VERSION and diffusers.__version__ == DIFFUSERS_VERSION and
            PIL.__version__ == PILLOW_VERSION and numpy.__version__ == NUMPY_VERSION)


def ensure_environment(venv):
    if pinned_versions_present():
        return
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
    subprocess.check_call(["bash", os.path.join(root, "bench", "yardstick_venv.sh"), os.path.abspath(venv)])
    python = os.path.join(venv, "bin", "python")
    subprocess.check_call([python, "-m", "pip", "install", "--quiet", f"pillow=={PILLOW_VERSION}",
                           f"numpy=={NUMPY_VERSION}"])
    os.execv(python, [python, *sys.argv])


def draw_source(rng, height, width):
    """Gradients, a few shapes of random colours and sizes, and a patch of thin stripes."""
    import numpy as np
    from PIL import Image, ImageDraw

    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    base = np.stack([
        96 + 80 * np.sin(2 * math.pi * (x / width * rng.uniform(0.5, 1.5) + rng.random())),
        96 + 80 * np.cos(2 * math.pi * (y / height * rng.uniform(0.5, 1.5) + rng.random())),
        128 + 100 * (x + y) / (width + height) - 50,
    ], axis=-1)
    image = Image.fromarray(np.clip(np.round(base), 0, 255).astype(np.uint8), "RGB")
    pen = ImageDraw.Draw(image)
    side = min(height, width)
    for _ in range(6):
        r = rng.uniform(0.05, 0.25) * side
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        colour = tuple(rng.randrange(256) for _ in range(3))
        if rng.random() < 0.5:
            pen.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
        else:
            pen.rectangle([cx - r, cy - r * 0.6, cx + r, cy + r * 0.6], fill=colour)
    # Stripes one and two pixels wide: detail at and near the Nyquist rate.
    x0, y0 = rng.randrange(0, max(1, width // 2)), rng.randrange(0, max(1, height // 2))
    for k in range(0, max(8, side // 4)):
        stripe = 1 + k % 2
        pen.line([(x0 + 3 * k, y0), (x0 + 3 * k, y0 + side // 4)], fill=(255, 255, 255), width=stripe)
    return image


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", required=True)
    parser.add_argument("--out", required=True, help="tests/golden/image_preprocess of the source tree")
    args = parser.parse_args()
    ensure_environment(args.venv)

    import numpy as np
    import torch
    from PIL import Image
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    torch.set_num_threads(1)
    rng = random.Random(SEED)
    os.makedirs(args.out, exist_ok=True)
    sources = {}
    for name, height, width in SOURCES:
        sources[name] = draw_source(rng, height, width)
        sources[name].save(os.path.join(args.out, f"source_{name}.png"), optimize=True)

    multiple_of = 16  # the pipelines' vae_scale_factor * 2
    flux2 = Flux2ImageProcessor(vae_scale_factor=multiple_of)
    kontext = VaeImageProcessor(vae_scale_factor=multiple_of)
    cases = []
    for source, pipeline in CASES:
        image = sources[source]
        case = {"source": f"source_{source}.png", "source_hw": [image.height, image.width], "pipeline": pipeline}
        if pipeline == "flux2":
            # Flux2Pipeline.__call__'s image preparation.
            try:
                flux2.check_image_input(image)
            except ValueError as error:
                case["error"] = str(error)
                cases.append(case)
                continue
            img = image
            if img.width * img.height > 1024 * 1024:
                img = flux2._resize_to_target_area(img, 1024 * 1024)
            w, h = img.width // multiple_of * multiple_of, img.height // multiple_of * multiple_of
            tensor = flux2.preprocess(img, height=h, width=w, resize_mode="crop")
        else:
            # FluxKontextPipeline.__call__'s, with _auto_resize.
            h, w = kontext.get_default_height_width(image)
            _, w, h = min((abs(w / h - pw / ph), pw, ph) for pw, ph in PREFERRED_KONTEXT_RESOLUTIONS)
            w, h = w // multiple_of * multiple_of, h // multiple_of * multiple_of
            tensor = kontext.preprocess(kontext.resize(image, h, w), h, w)
        pixels = torch.round((tensor[0] + 1) / 2 * 255)
        assert torch.equal(pixels / 255 * 2 - 1, tensor[0]), "the processed tensor is not an 8-bit image"
        expected = f"expected_{pipeline}_{source}.png"
        Image.fromarray(pixels.permute(1, 2, 0).to(torch.uint8).numpy(), "RGB").save(
            os.path.join(args.out, expected), optimize=True)
        case.update({"expected": expected, "expected_hw": [int(tensor.shape[2]), int(tensor.shape[3])]})
        cases.append(case)

    with open(os.path.join(args.out, "case.json"), encoding="utf-8") as f:
        described = json.load(f)
    described["cases"] = cases
    described["made_by"] = (f"tests/golden/tools/make_image_preprocess_cases.py (diffusers {DIFFUSERS_VERSION}, "
                            f"torch {TORCH_VERSION}, Pillow {PILLOW_VERSION}, seed {SEED})")
    with open(os.path.join(args.out, "case.json"), "w", encoding="utf-8") as f:
        json.dump(described, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()

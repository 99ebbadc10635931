"""Procedural scenes for the built-in model: simple shapes on plain backgrounds, with captions.

The vocabulary (shapes, colours, sizes, positions, backgrounds, counts) is what the built-in model
learns to draw, and what the drawing test and the quick start's prompts use. A scene is drawn from
a seeded `random.Random`, so a seed gives the same scenes on every platform; images are drawn with
Pillow (pinned by tools/train_builtin_model.py).

    python3 tools/builtin_scenes.py --count 16 --out DIR   # writes scene PNGs and captions.txt
"""
import argparse
import math
import os
import random

# The colours a caption can name, as RGB. Each is far from the others and from the default
# background, so that a picture can be checked for the named colour.
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (245, 215, 30),
    "orange": (245, 130, 20),
    "purple": (140, 40, 180),
    "white": (250, 250, 250),
    "black": (15, 15, 15),
}
# The background when the caption names none: a mid gray, none of the colours above.
DEFAULT_BACKGROUND = (128, 128, 128)
SHAPES = ["circle", "square", "triangle", "star"]
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles", "star": "stars"}
# Radius (half the extent) as a fraction of the image side; "" is the unnamed, medium size.
SIZES = {"small": 0.09, "": 0.14, "large": 0.21}
# Position phrases and their centres (x, y) as fractions of the side; y grows downwards.
POSITIONS = {
    "at the top left": (0.22, 0.22),
    "at the top": (0.5, 0.22),
    "at the top right": (0.78, 0.22),
    "on the left": (0.22, 0.5),
    "in the center": (0.5, 0.5),
    "on the right": (0.78, 0.5),
    "at the bottom left": (0.22, 0.78),
    "at the bottom": (0.5, 0.78),
    "at the bottom right": (0.78, 0.78),
}


class Scene:
    """What a caption says: a list of (shape, colour, size, centre) and a background."""

    def __init__(self, caption, background, objects):
        self.caption = caption
        self.background = background  # RGB
        self.objects = objects  # [(shape, rgb, radius_fraction, (cx, cy) fractions)]


def shape_points(shape, cx, cy, r):
    """The polygon of `shape` with centre (cx, cy) and radius r in pixels (None for a circle)."""
    if shape == "square":
        s = r * 0.9
        return [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    if shape == "triangle":
        return [(cx + r * math.cos(a), cy + r * 0.15 + r * math.sin(a))
                for a in (-math.pi / 2, -math.pi / 2 + 2 * math.pi / 3, -math.pi / 2 + 4 * math.pi / 3)]
    if shape == "star":
        points = []
        for k in range(10):
            radius = r if k % 2 == 0 else r * 0.42
            a = -math.pi / 2 + k * math.pi / 5
            points.append((cx + radius * math.cos(a), cy + radius * math.sin(a)))
        return points
    return None


def draw(scene, size):
    """The scene as a Pillow RGB image of size x size (drawn at 2x and reduced: smooth edges)."""
    from PIL import Image, ImageDraw

    big = 2 * size
    image = Image.new("RGB", (big, big), scene.background)
    pen = ImageDraw.Draw(image)
    for shape, rgb, radius, (cx, cy) in scene.objects:
        x, y, r = cx * big, cy * big, radius * big
        points = shape_points(shape, x, y, r)
        if points is None:
            pen.ellipse([x - r, y - r, x + r, y + r], fill=rgb)
        else:
            pen.polygon(points, fill=rgb)
    return image.resize((size, size), Image.BOX)


def random_scene(rng):
    """A scene and its caption: mostly one shape, sometimes two of the same kind."""
    colour = rng.choice(list(COLOURS))
    shape = rng.choice(SHAPES)
    named_background = rng.random() < 0.6
    background_name = rng.choice([c for c in COLOURS if c != colour]) if named_background else None
    background = COLOURS[background_name] if named_background else DEFAULT_BACKGROUND
    suffix = f" on a {background_name} background" if named_background else ""
    jitter = lambda: rng.uniform(-0.04, 0.04)
    if rng.random() < 0.15:
        # Two of the same shape, side by side or one above the other, unnamed size.
        radius = SIZES[""] * rng.uniform(0.8, 1.0)
        if rng.random() < 0.5:
            centres = [(0.27 + jitter(), 0.5 + jitter()), (0.73 + jitter(), 0.5 + jitter())]
        else:
            centres = [(0.5 + jitter(), 0.27 + jitter()), (0.5 + jitter(), 0.73 + jitter())]
        caption = f"two {colour} {PLURALS[shape]}{suffix}"
        return Scene(caption, background, [(shape, COLOURS[colour], radius, c) for c in centres])
    size = rng.choice(list(SIZES))
    radius = SIZES[size] * rng.uniform(0.9, 1.1)
    if rng.random() < 0.9:
        position = rng.choice(list(POSITIONS))
        cx, cy = POSITIONS[position]
        where = " " + position
    else:
        cx, cy = rng.uniform(0.25, 0.75), rng.uniform(0.25, 0.75)
        where = ""
    words = " ".join(w for w in ("a", size, colour, shape) if w)
    caption = f"{words}{where}{suffix}"
    return Scene(caption, background, [(shape, COLOURS[colour], radius, (cx + jitter(), cy + jitter()))])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.seed)
    with open(os.path.join(args.out, "captions.txt"), "w") as captions:
        for i in range(args.count):
            scene = random_scene(rng)
            draw(scene, args.size).save(os.path.join(args.out, f"scene_{i:04d}.png"))
            captions.write(f"scene_{i:04d}.png\t{scene.caption}\n")


if __name__ == "__main__":
    main()

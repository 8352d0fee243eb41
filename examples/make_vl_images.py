"""Draw the small images examples/vl_prompts.jsonl refers to (no downloads): run once before the VL example.

    .venv/bin/python examples/make_vl_images.py
    .venv/bin/expstream run --prompts examples/vl_prompts.jsonl --output runs/vl --set models.actor=builtin:tiny-vl
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent / "images"


def draw(name: str, size: tuple[int, int], colour: str, shape: str) -> None:
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    w, h = size
    box = (w // 5, h // 5, 4 * w // 5, 4 * h // 5)
    if shape == "circle":
        d.ellipse(box, fill=colour)
    elif shape == "square":
        d.rectangle(box, fill=colour)
    else:
        d.polygon([(w // 2, h // 5), (w // 5, 4 * h // 5), (4 * w // 5, 4 * h // 5)], fill=colour)
    img.save(HERE / name)


def main() -> None:
    HERE.mkdir(exist_ok=True)
    draw("red_circle.png", (64, 64), "red", "circle")
    draw("blue_square.png", (100, 70), "blue", "square")
    draw("green_triangle.png", (80, 80), "green", "triangle")
    print(f"wrote 3 images to {HERE}")


if __name__ == "__main__":
    main()

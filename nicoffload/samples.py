"""Deterministic sample inputs for `--sample N`, tests and benchmarks: JPEGs and English texts.

Images are built from the real photographs scikit-image ships offline (mosaics of rescaled crops,
camera-like sharpening and sensor noise, so they compress like photos do), in the size, quality,
subsampling and progressive mix of a serving workload. Item i depends only on (seed, i).
"""

from __future__ import annotations

import io
from functools import lru_cache
from pathlib import Path

import numpy as np

from nicoffload.errors import MissingDependency

# (width, height, weight): ImageNet-like sizes mostly, then phone and camera sizes up to 1080p.
_SIZES = (
    (500, 375, 30),
    (375, 500, 12),
    (500, 333, 15),
    (333, 500, 5),
    (640, 480, 10),
    (800, 600, 6),
    (1024, 768, 6),
    (1280, 720, 6),
    (1920, 1080, 5),
    (1080, 1920, 3),
)
_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry")
_TILE = 700  # the longest side of one mosaic tile
_SUBSAMPLING = ((2, "420", 0.7), (0, "444", 0.2), (1, "422", 0.1))  # PIL code, name, share
_NOISE_HW = (1150, 2000)
# Pre-scaled copies of each photo (output pixels per source pixel); tiles are plain crops of them.
_SCALES = (0.5, 0.7, 1.0, 1.4, 2.0)


@lru_cache(maxsize=1)
def _photos() -> tuple:
    try:
        import skimage.data
        from PIL import Image
    except ImportError:
        raise MissingDependency("scikit-image", "samples", "sample images") from None
    from PIL import ImageFilter

    photos = [getattr(skimage.data, name)() for name in _PHOTOS]
    photos.append(skimage.data.stereo_motorcycle()[0])
    # Camera-like sharpening, once per photo: real JPEGs carry more fine detail than these.
    sharpen = ImageFilter.UnsharpMask(radius=1.5, percent=150, threshold=1)
    return tuple(Image.fromarray(np.ascontiguousarray(p[..., :3])).filter(sharpen) for p in photos)


@lru_cache(maxsize=1)
def _noise() -> tuple[np.ndarray, np.ndarray]:
    """Sensor-like noise (mostly luma, shared by the channels; a little chroma), flat, as its
    positive and negative parts, so adding it is two saturating uint8 steps."""
    rng = np.random.default_rng(20240917)
    luma = rng.normal(0.0, 4.0, (*_NOISE_HW, 1))
    chroma = rng.normal(0.0, 2.0, (*_NOISE_HW, 3))
    noise = np.clip(np.rint(luma + chroma), -255, 255).astype(np.int16).reshape(-1)
    return np.clip(noise, 0, None).astype(np.uint8), np.clip(-noise, 0, None).astype(np.uint8)


@lru_cache(maxsize=128)
def _scaled(index: int, scale: float, flip: bool) -> np.ndarray:
    from PIL import Image

    photo = _photos()[index]
    size = (round(photo.size[0] * scale), round(photo.size[1] * scale))
    scaled = photo.resize(size, Image.BICUBIC)
    return np.asarray(scaled.transpose(Image.FLIP_LEFT_RIGHT) if flip else scaled)


def _tile(rng: np.random.Generator, th: int, tw: int) -> np.ndarray:
    index = int(rng.integers(len(_PHOTOS) + 1))
    sw, sh = _photos()[index].size
    fits = [s for s in _SCALES if sw * s >= tw + 1 and sh * s >= th + 1]
    scale = fits[rng.integers(min(len(fits), 3))] if fits else max(_SCALES)
    src = _scaled(index, scale, bool(rng.random() < 0.5))
    oy = rng.integers(0, max(src.shape[0] - th, 0) + 1)
    ox = rng.integers(0, max(src.shape[1] - tw, 0) + 1)
    tile = src[oy : oy + th, ox : ox + tw]
    if tile.shape[:2] != (th, tw):  # a source smaller than the cell: mirrored to fill it
        # (the cell's rest was left as np.empty found it: the same item differed run to run)
        pad = ((0, th - tile.shape[0]), (0, tw - tile.shape[1]), (0, 0))
        tile = np.pad(tile, pad, mode="symmetric")
    return tile


def _image(rng: np.random.Generator) -> tuple[np.ndarray, int, int]:
    sizes = np.array([s[2] for s in _SIZES], float)
    w, h, _ = _SIZES[rng.choice(len(_SIZES), p=sizes / sizes.sum())]
    nx, ny = -(-w // _TILE), -(-h // _TILE)
    xs, ys = np.linspace(0, w, nx + 1).astype(int), np.linspace(0, h, ny + 1).astype(int)
    canvas = np.empty((h, w, 3), np.uint8)
    for j in range(ny):
        for i in range(nx):
            tile = _tile(rng, ys[j + 1] - ys[j], xs[i + 1] - xs[i])
            canvas[ys[j] : ys[j] + tile.shape[0], xs[i] : xs[i] + tile.shape[1]] = tile
    # The noise is i.i.d. per pixel, so any pixel-aligned run of the field will do.
    up, down = _noise()
    start = 3 * rng.integers(0, (up.size - canvas.size) // 3 + 1)
    px, room = canvas.reshape(-1), np.empty(canvas.size, np.uint8)
    np.minimum(np.bitwise_not(px, out=room), up[start : start + px.size], out=room)
    px += room  # saturating add: never more than the room left below 255
    px -= np.minimum(px, down[start : start + px.size], out=room)
    return canvas, w, h


def sample_image(i: int, seed: int = 0) -> tuple[str, bytes]:
    """Item i of the image corpus: (file name, JPEG bytes)."""
    import simplejpeg
    from PIL import Image

    rng = np.random.default_rng([seed, i, 1])
    pixels, w, h = _image(rng)
    quality = round(95 - 20 * rng.random() ** 2)  # skewed high, like photo collections
    shares = [s[2] for s in _SUBSAMPLING]
    code, sub, _ = _SUBSAMPLING[rng.choice(len(_SUBSAMPLING), p=shares)]
    # Progressive mostly on web-sized images (and PIL's progressive encoder is slow on big ones).
    progressive = bool(rng.random() < 0.2) and w * h <= 500_000
    if progressive:
        buf = io.BytesIO()
        Image.fromarray(pixels).save(
            buf, "JPEG", quality=quality, subsampling=code, progressive=True
        )
        data = buf.getvalue()
    else:
        data = simplejpeg.encode_jpeg(pixels, quality, colorsubsampling=sub)
    name = f"img{i:05d}_{w}x{h}_q{quality}_{sub}{'_prog' if progressive else ''}.jpg"
    return name, data


def sample_images(n: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """n realistic JPEGs (500x375 up to 1920x1080, quality 75-95, mostly 4:2:0, some progressive)."""
    return [sample_image(i, seed) for i in range(n)]


# Public-domain English prose (Austen, Dickens, Melville, Doyle, Darwin, Twain, Carroll, Lincoln).
_SENTENCES = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.",
    "Call me Ishmael.",
    "Some years ago, never mind how long precisely, having little or no money in my purse, and nothing particular to interest me on shore, I thought I would sail about a little and see the watery part of the world.",
    "To Sherlock Holmes she is always the woman.",
    "You see, but you do not observe.",
    "When you have eliminated the impossible, whatever remains, however improbable, must be the truth.",
    "There is grandeur in this view of life, with its several powers, having been originally breathed into a few forms or into one.",
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do.",
    "Curiouser and curiouser!",
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in Liberty, and dedicated to the proposition that all men are created equal.",
    "You don't know about me without you have read a book by the name of The Adventures of Tom Sawyer; but that ain't no matter.",
    "The sun did not shine, it was too wet to play, so we sat in the house all that cold, cold, wet day.",
    "Happy families are all alike; every unhappy family is unhappy in its own way.",
    "The mass of men lead lives of quiet desperation.",
    "I went to the woods because I wished to live deliberately, to front only the essential facts of life.",
    "Whenever I find myself growing grim about the mouth, I account it high time to get to sea as soon as I can.",
    "Marley was dead: to begin with.",
    "The weather was fine, the road was long, and the coach rattled over the stones of the old town before noon.",
    "In the course of a long life I have observed that the most valuable knowledge is the knowledge of how little we know.",
    "Natural selection acts only by taking advantage of slight successive variations; she can never take a great and sudden leap.",
    "The river was wide and slow, and on its banks the willows leaned over the water as if to read their own reflections.",
    "He had the look of a man who has been long in the open air, and whose thoughts have been far away.",
    "There was no possibility of taking a walk that day.",
    "I am no bird; and no net ensnares me: I am a free human being with an independent will.",
    "All happy things must end, and the evening came on with a grey light over the hills.",
    "The old man had a small bag of provisions and a stick, and he walked steadily toward the village.",
    "Reader, I married him.",
    "It was a bright cold day in April, and the clocks were striking the hour as the train pulled into the station.",
    "The first thing to be done was to find out where the noise came from, and the second was to make it stop.",
    "A large rose-tree stood near the entrance of the garden: the roses growing on it were white, but there were three gardeners at it, busily painting them red.",
    "Nothing is more usual than for a man to fancy that he understands a subject because he has read a book about it.",
    "The letter lay on the table for three days before anyone thought to open it.",
    "Every one of the ships in the harbour had its flag at half mast, and the sailors stood silent on the decks.",
    "Men of few words are the best men.",
    "I declare after all there is no enjoyment like reading!",
    "The storm broke over the town at midnight, and by morning the streets were rivers running down to the sea.",
    "It is not down in any map; true places never are.",
    "We are all in the gutter, but some of us are looking at the stars.",
    "The world is too much with us; late and soon, getting and spending, we lay waste our powers.",
    "She had a way of listening that made every speaker feel that his words were the most important ever spoken.",
    "The doctor examined the patient carefully, wrote a few words in his notebook, and said nothing for a long while.",
    "After dinner the company moved into the drawing room, where a fire had been lit against the chill of the evening.",
    "Education is the best provision for old age.",
    "There is nothing like looking, if you want to find something.",
    "The engine gave a long whistle, the carriages jolted, and the platform slid slowly away behind them.",
)


def sample_text(i: int, seed: int = 0) -> tuple[str, str]:
    """Item i of the text corpus: (file name, English text of 5-200 words)."""
    rng = np.random.default_rng([seed, i, 2])
    n_words = int(np.clip(rng.lognormal(np.log(40), 0.8), 5, 200))
    words: list[str] = []
    while len(words) < n_words:
        words += _SENTENCES[rng.integers(len(_SENTENCES))].split()
    text = " ".join(words[:n_words]).rstrip(",;:")
    if text[-1] not in ".!?":
        text += "."
    return f"text{i:05d}_{n_words}w.txt", text


def sample_texts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n English texts of 5-200 words composed from public-domain sentences."""
    return [sample_text(i, seed) for i in range(n)]


def write_samples(directory: str | Path, n: int, kind: str = "image", seed: int = 0) -> list[Path]:
    """Write n samples of `kind` ("image": .jpg, "text": .txt) into directory; return the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if kind == "image":
        for name, data in sample_images(n, seed):
            (out / name).write_bytes(data)
            paths.append(out / name)
    elif kind == "text":
        for name, text in sample_texts(n, seed):
            (out / name).write_text(text, encoding="utf-8")
            paths.append(out / name)
    else:
        raise ValueError(f"kind must be 'image' or 'text', got {kind!r}")
    return paths

import glob, io, time, statistics, torch
from PIL import Image
from torchvision.io import decode_jpeg, ImageReadMode
torch.set_num_threads(1)
files = sorted(glob.glob("runs/bench-images/*/*.jpg"))[:300]
orig = [open(f, "rb").read() for f in files]
def shrink(b, side):
    im = Image.open(io.BytesIO(b)); im.load()
    w, h = im.size; s = side / min(w, h)
    im = im.resize((round(w * s), round(h * s)), Image.BICUBIC)
    out = io.BytesIO(); im.save(out, "JPEG", quality=90); return out.getvalue()
sets = {"original": orig, "short side 256, q90": [shrink(b, 256) for b in orig]}
for name, data in sets.items():
    ts = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in data]
    rates = []
    for _ in range(4):
        t = time.perf_counter()
        for x in ts: decode_jpeg(x, mode=ImageReadMode.RGB)
        rates.append(len(ts) / (time.perf_counter() - t))
    im = Image.open(io.BytesIO(data[0]))
    print(f"{name}: {statistics.median(rates[1:]):,.0f} img/s one thread (range {min(rates[1:]):,.0f}-{max(rates[1:]):,.0f}), "
          f"{sum(map(len, data)) / len(data) / 1e3:.0f} kB, e.g. {im.size}")

"""Writes the bundled demo tile: layers 0 and 5 (q, k, v) of ../shared/data's capture.

Usage: python3 data/trim_tile.py ../shared/data/smollm2-alice-kv.safetensors data/smollm2-alice-kv-l0-l5.safetensors
Plain byte slicing (safetensors is a JSON header plus raw little-endian arrays), no numpy.
"""
import json, struct, sys

src, dst = sys.argv[1], sys.argv[2]
keep = [f"layer{l}.{t}" for l in (0, 5) for t in ("q", "k", "v")]
with open(src, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
    body = f.read()
meta = header.pop("__metadata__", {})
meta = {k: v for k, v in meta.items() if k not in ("verify", "max_abs")}
meta["layers"] = "[0, 5]"
meta["trimmed_from"] = src.rsplit("/", 1)[-1]
out_header, chunks, off = {"__metadata__": meta}, [], 0
for name in keep:
    info = header[name]
    a, b = info["data_offsets"]
    chunks.append(body[a:b])
    out_header[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [off, off + b - a]}
    off += b - a
h = json.dumps(out_header, separators=(",", ":")).encode()
h += b" " * (-len(h) % 8)
with open(dst, "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h + b"".join(chunks))

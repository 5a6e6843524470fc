"""Device probe (throwaway, not committed): where the decode=gpu loader's time goes, nvJPEG's scaling over threads and
processes, and the CPU decode in worker processes. Writes $OUT/probe.json after every figure."""
import cProfile
import io
import json
import os
import pickle
import pstats
import sys
import threading
import time

OUT = os.environ.get("OUT", "/tmp")
RES = {}


def save():
    with open(f"{OUT}/probe.json", "w") as f:
        json.dump(RES, f, indent=1)


def raw_child(path, seconds, start_at, q):
    import torch
    import torchvision.io as tv
    contents = pickle.load(open(path, "rb"))
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    data = [torch.frombuffer(bytearray(c), dtype=torch.uint8) for c in contents]
    batches = [data[i:i + 256] for i in range(0, len(data), 256)]
    tv.decode_jpeg(batches[0], device=dev, mode=tv.ImageReadMode.RGB)
    torch.cuda.synchronize()
    while time.time() < start_at:
        time.sleep(0.001)
    n, k, t0 = 0, 0, time.time()
    while time.time() - t0 < seconds:
        tv.decode_jpeg(batches[k % len(batches)], device=dev, mode=tv.ImageReadMode.RGB)
        torch.cuda.synchronize()
        n += len(batches[k % len(batches)])
        k += 1
    q.put(n / (time.time() - t0))


def main():
    import multiprocessing as mp

    import torch
    import torchvision
    import torchvision.io as tv
    from bench.photos_data import rendered
    t0 = time.time()
    rows = rendered(2048, 5, 0, 16)
    contents = [r[0] for r in rows]
    RES["render_s"] = time.time() - t0
    RES["torch"], RES["torchvision"] = torch.__version__, torchvision.__version__
    RES["cpu_count"] = os.cpu_count()
    path = "/tmp/probe_contents.pkl"
    pickle.dump(contents, open(path, "wb"))
    dev = torch.device("cuda")
    mode = tv.ImageReadMode.RGB

    # A. raw nvJPEG batched decode, 1 thread, 2 threads, then P processes
    t = time.perf_counter()
    data = [torch.frombuffer(bytearray(c), dtype=torch.uint8) for c in contents[:256]]
    RES["prep_frombuffer_ms_per_256"] = (time.perf_counter() - t) * 1e3
    data = [torch.frombuffer(bytearray(c), dtype=torch.uint8) for c in contents]
    batches = [data[i:i + 256] for i in range(0, len(data), 256)]
    for b in batches[:2]:
        tv.decode_jpeg(b, device=dev, mode=mode)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for b in batches:
        tv.decode_jpeg(b, device=dev, mode=mode)
    torch.cuda.synchronize()
    RES["raw_1thread_img_s"] = len(data) / (time.perf_counter() - t)
    # per-image (unbatched) calls for contrast
    t = time.perf_counter()
    for x in data[:256]:
        tv.decode_jpeg(x, device=dev, mode=mode)
    torch.cuda.synchronize()
    RES["raw_single_image_calls_img_s"] = 256 / (time.perf_counter() - t)
    save()
    for threads in (2, 4):
        def work(part):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for b in part:
                    tv.decode_jpeg(b, device=dev, mode=mode)
                s.synchronize()
        parts = [batches[i::threads] for i in range(threads)]
        t = time.perf_counter()
        ths = [threading.Thread(target=work, args=(p,)) for p in parts]
        [x.start() for x in ths]
        [x.join() for x in ths]
        RES[f"raw_{threads}threads_img_s"] = len(data) / (time.perf_counter() - t)
        save()
    ctx = mp.get_context("spawn")
    for procs in (1, 2, 4):
        q = ctx.Queue()
        start_at = time.time() + 15
        ps = [ctx.Process(target=raw_child, args=(path, 4.0, start_at, q)) for _ in range(procs)]
        [p.start() for p in ps]
        try:
            rates = [q.get(timeout=60) for _ in ps]
            RES[f"raw_{procs}procs_img_s"] = sum(rates)
            RES[f"raw_{procs}procs_each"] = rates
        except Exception as exc:
            RES[f"raw_{procs}procs_error"] = repr(exc)
        [p.join(10) for p in ps]
        save()

    # B. the product's GpuDecoder, synchronous, its parts timed, and under cProfile
    import numpy as np
    from pipeline.data.crops import boxes_for, header
    from pipeline.data.decode import EncodedBatch
    from pipeline.data.gpu_decode import GpuDecoder, resized_crops
    dec = GpuDecoder(224, 3, train=True, seed=0, device=dev, channels_last=True)
    ebs = []
    for i in range(8):
        r = np.empty((256, 2), dtype=object)
        r[:, 0] = contents[i * 256:(i + 1) * 256]
        r[:, 1] = [f"/p/{i}_{j}.jpg" for j in range(256)]
        ebs.append(EncodedBatch(r, i))
    parts = {"headers": 0.0, "boxes": 0.0, "frombuffer": 0.0, "decode": 0.0, "resize": 0.0}
    for rep in range(2):
        for eb in ebs:
            t = time.perf_counter(); hs = [header(c, p, 10 ** 9) for c, p in eb.rows]; t1 = time.perf_counter()
            bx = boxes_for([h[:2] for h in hs], True, 0, eb.index); t2 = time.perf_counter()
            d = [torch.frombuffer(bytearray(c), dtype=torch.uint8) for c in eb.rows[:, 0]]; t3 = time.perf_counter()
            imgs = tv.decode_jpeg(d, device=dev, mode=mode); torch.cuda.synchronize(); t4 = time.perf_counter()
            for lo in range(0, 256, 64):
                resized_crops(imgs[lo:lo + 64], bx[lo:lo + 64], 224)
            torch.cuda.synchronize(); t5 = time.perf_counter()
            if rep:
                for k, v in zip(parts, (t1 - t, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                    parts[k] += v * 1e3 / len(ebs)
    RES["gpudecoder_parts_ms_per_256"] = parts
    t = time.perf_counter()
    for eb in ebs:
        dec.decode(eb)
    torch.cuda.synchronize()
    RES["gpudecoder_sync_img_s"] = 256 * len(ebs) / (time.perf_counter() - t)
    # through its threads (the loader's way): batches() with depth 2 and 4
    for depth in (2, 4):
        items = [(eb, None) for eb in ebs] * 2
        t = time.perf_counter()
        for x, _ in dec.batches(iter(items), depth=depth):
            pass
        torch.cuda.synchronize()
        RES[f"gpudecoder_threads_depth{depth}_img_s"] = 256 * len(items) / (time.perf_counter() - t)
    save()
    pr = cProfile.Profile()
    pr.enable()
    for eb in ebs[:4]:
        dec.decode(eb)
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    RES["gpudecoder_profile_tottime"] = s.getvalue()[-6000:]
    dec.close()
    save()


if __name__ == "__main__":
    main()

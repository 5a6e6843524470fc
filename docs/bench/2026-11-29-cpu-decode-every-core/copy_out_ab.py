"""Before/after of the decoder's copy out of the ring, in one process, taking turns: torch's copy_ (before) against
numpy's single-threaded copy (after); 2 workers on this 2-core machine, 512 ImageNet-shaped photos, batches of 128."""
import sys, json, statistics
sys.path.insert(0, "/work/main")
import pipeline.data.decode as dm
from bench.photo_decode import imagenet_photos, _decoder_images_per_s
from bench.photos_data import pillow_images_per_s, pillow_every_core_images_per_s
photos = imagenet_photos(512)
after = dm._host_copy
def before(out, src): out.copy_(src)
res = {"before": [], "after": [], "pillow_one_core": [], "pillow_every_core": []}
_decoder_images_per_s(photos[:256], 2, 128)
for r in range(6):
    for name, fn in ((("before", before), ("after", after)) if r % 2 == 0 else (("after", after), ("before", before))):
        dm._host_copy = fn
        res[name].append(_decoder_images_per_s(photos, 2, 128))
    res["pillow_one_core"].append(pillow_images_per_s(photos))
    res["pillow_every_core"].append(pillow_every_core_images_per_s(photos, 2))
med = {k: statistics.median(v) for k, v in res.items()}
print(json.dumps({"median_images_per_s": med, "runs": res,
                  "after_over_before": med["after"] / med["before"],
                  "per_core_over_pillow": {k: med[k] / 2 / med["pillow_one_core"] for k in ("before", "after")},
                  "over_pillow_every_core": {k: med[k] / med["pillow_every_core"] for k in ("before", "after")}}, indent=1))

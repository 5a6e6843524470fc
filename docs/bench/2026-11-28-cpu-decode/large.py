import json, time, torch
torch.set_num_threads(1)
from bench.photo_decode import phone_photos, crop_jobs, _decode_all
jobs = crop_jobs(phone_photos(6))
_decode_all(jobs, False); _decode_all(jobs, True)
print(json.dumps({"draft": _decode_all(jobs, False)[0], "full": _decode_all(jobs, True)[0]}))

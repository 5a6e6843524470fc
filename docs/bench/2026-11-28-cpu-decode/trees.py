import sys, time, json, numpy as np, torch
torch.set_num_threads(1)
from pipeline.lakehouse.sample_data import PHOTO_CLASSES, render_photo
from pipeline.data.decode import Decoder, EncodedBatch
photos=[render_photo(PHOTO_CLASSES[i % 5], 13, i)[0] for i in range(512)]
rows=np.empty((512,2),dtype=object); rows[:,0]=photos; rows[:,1]=[f"p{i}" for i in range(512)]
def rate(w, batch=128):
    d=Decoder(224,3,train=True,seed=0,workers=w,channels_last=True)
    try:
        d.decode(EncodedBatch(rows[:batch],0))
        items=((EncodedBatch(rows[lo:lo+batch],1+lo//batch),) for lo in range(0,512,batch))
        t=time.perf_counter(); n=sum(len(o) for (o,) in d.batches(items)); return n/(time.perf_counter()-t)
    finally: d.close()
import io
from PIL import Image
def pil():
    t=time.perf_counter()
    for c in photos:
        with Image.open(io.BytesIO(c)) as im: im.convert("RGB").load()
    return len(photos)/(time.perf_counter()-t)
pil(); rate(1); rate(2)
print(json.dumps({"pillow": pil(), "w1": rate(1), "w2": rate(2)}))

import time, numpy as np, torch
from PIL import Image
from omni_models import synthetic, load
t=time.time()
comp = synthetic.flux_components("tiny", guidance_embeds=True)
d = synthetic.save_checkpoint("flux-kontext", comp, __import__("pathlib").Path("/tmp/k28/ckpt"))
print("saved", time.time()-t)
pipe = load(str(d))
print(pipe.info)
rng = np.random.default_rng(0)
img = Image.fromarray(rng.integers(0,255,(32,32,3),dtype=np.uint8))
ref = synthetic.diffusers_pipeline("flux-kontext", comp)
def psnr(a,b):
    x,y=np.asarray(a,float),np.asarray(b,float); m=((x-y)**2).mean(); return float('inf') if m==0 else 10*np.log10(255**2/m)
for kw in [dict(), dict(negative_prompt="blurry", true_cfg_scale=2.0)]:
    ours = pipe("a red circle", image=img, num_inference_steps=3, guidance_scale=2.5, seed=7, height=32, width=32, num_images_per_prompt=2, **kw)
    theirs = ref(image=img, prompt="a red circle", num_inference_steps=3, guidance_scale=2.5, generator=[torch.Generator("cpu").manual_seed(7+i) for i in range(2)], height=32, width=32, max_area=32*32, _auto_resize=False, num_images_per_prompt=2, **kw).images
    print(kw, [psnr(a,b) for a,b in zip(ours,theirs)])

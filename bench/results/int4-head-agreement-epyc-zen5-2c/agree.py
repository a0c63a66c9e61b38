"""Agreement with fp32 of int4 (head int8 + wide tensors int8) vs all-int4, per model."""
import sys, time, json
from types import SimpleNamespace
import torch
from yggdrasil.compile import formats, recipe as rmod
from yggdrasil import quant
from yggdrasil.loader import load
from yggdrasil.steps import StepRunner
torch.set_num_threads(2)
recipe_path, model_name = sys.argv[1], sys.argv[2]
rec = rmod.load_recipe(__import__("pathlib").Path(recipe_path))
fp32 = load(model_name, quiet=True)
ctx = SimpleNamespace(recipe=rec, target=fp32)
t = time.time()
ref = formats.build_reference(ctx, StepRunner(fp32.model, rec.max_context, 64))
print("reference", time.time() - t, "s", sum(len(a) for a in ref.argmax), "positions", flush=True)
print("fp32 perplexity", formats.perplexity(StepRunner(fp32.model, rec.max_context, 64), ref), flush=True)
del fp32
out = {}
for label in ("int4-mixed", "int4-all"):
    if label == "int4-all":
        quant.int4_kept_int8 = lambda model, gguf=None: set()
    m = load(model_name, quiet=True, weights="int4")
    r = StepRunner(m.model, rec.max_context, 64)
    a, n = formats.agreement(r, ref)
    ppl = formats.perplexity(r, ref)
    out[label] = dict(agreement=round(a, 4), positions=n, perplexity=ppl and round(ppl, 3),
                      weight_mb=round(quant.weight_bytes(m.model) / 1e6))
    print(label, out[label], flush=True)
    del m, r
print(json.dumps(out))

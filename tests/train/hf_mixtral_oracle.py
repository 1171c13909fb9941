# Loads a `moe export --format hf` folder with transformers (fp32, as users would:
# AutoModelForCausalLM / AutoTokenizer) and checks it against our model's own outputs:
#   hf_mixtral_oracle.py EXPORT_DIR TOKENS_FILE LOGITS_FILE GREEDY_FILE TEXT_FILE
# TOKENS_FILE: int32 prompt ids; LOGITS_FILE: float32 [len(tokens), vocab] logits of our
# full forward over them; GREEDY_FILE: int32 ids our greedy decoding appended to the
# prompt (may be empty: not checked); TEXT_FILE: a text whose ids under the exported
# tokenizer must equal our tokenizer's (the int32 file TEXT_FILE + ".ids").
# Prints "OK <max relative logit error>" or fails with an assertion naming what differs.
import json
import os
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

out, tokens_file, logits_file, greedy_file, text_file = sys.argv[1:6]
torch.manual_seed(0)
tokens = np.fromfile(tokens_file, dtype=np.int32)
cfg = json.load(open(os.path.join(out, "config.json")))
V = cfg["vocab_size"]
ours = np.fromfile(logits_file, dtype=np.float32).reshape(len(tokens), V)

model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
model.eval()
assert type(model).__name__ == "MixtralForCausalLM", type(model).__name__
with torch.no_grad():
    theirs = model(torch.tensor(tokens[None, :], dtype=torch.long)).logits[0].numpy()
scale = float(np.max(np.abs(theirs)))
err = float(np.max(np.abs(theirs - ours))) / scale
assert err <= 1e-4, "logits differ: max |ours - transformers| / max |logit| = %.3g" % err
# Elementwise too: each logit within 1e-4 relative (with the same floor for those near 0).
bad = np.abs(theirs - ours) > 1e-4 * np.maximum(np.abs(theirs), 0.05 * scale)
assert not bad.any(), "logit (%d, %d): ours %r transformers %r" % (*np.argwhere(bad)[0], ours[bad][0], theirs[bad][0])

greedy = np.fromfile(greedy_file, dtype=np.int32)
if len(greedy):
    with torch.no_grad():
        gen = model.generate(torch.tensor(tokens[None, :], dtype=torch.long), max_new_tokens=len(greedy),
                             do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(tokens):].numpy()
    assert list(gen) == list(greedy), "greedy tokens differ: transformers %s, ours %s" % (list(gen), list(greedy))

tok = AutoTokenizer.from_pretrained(out)
text = open(text_file, encoding="utf-8", errors="surrogateescape").read()
ids = np.fromfile(text_file + ".ids", dtype=np.int32)
theirs_ids = tok(text, add_special_tokens=False)["input_ids"]
assert list(theirs_ids) == list(ids), "tokenizer ids differ: %s vs ours %s" % (theirs_ids[:20], list(ids[:20]))
assert tok.decode(theirs_ids) == text, "decode does not round-trip"
gen_cfg = json.load(open(os.path.join(out, "generation_config.json")))
assert tok.eos_token_id == cfg["eos_token_id"] == gen_cfg["eos_token_id"] and tok.eos_token_id is not None, (
    tok.eos_token_id, cfg["eos_token_id"], gen_cfg["eos_token_id"])
print("OK %.3g" % err)

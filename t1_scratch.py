import torch, time
from transformers import AutoConfig, AutoModelForCausalLM
from tests.helpers import HF_SMALL
import tspc
GPT2 = {"n_inner": 128, "bos_token_id": 1, "eos_token_id": 2}
import sys
attn = sys.argv[1] if len(sys.argv)>1 else "sdpa"
cfg = AutoConfig.for_model("gpt2", **{**HF_SMALL, **GPT2})
cfg._attn_implementation = attn
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(cfg).train()
m.loss_type = "ForCausalLM"
ids = torch.randint(1,128,(2,16), generator=torch.Generator().manual_seed(3))
c = torch.compile(m, backend="tsp", fullgraph=True)
t=time.time()
torch.manual_seed(5)
out = c(input_ids=ids, labels=ids)
out.loss.backward()
print("loss", out.loss.item(), time.time()-t)
rep = tspc.last_report()
print(rep.level, rep.notes)
print([ (e.module, e.status, e.reason) for e in rep.entries])
torch.manual_seed(5)
out2 = c(input_ids=ids, labels=ids); print("again", out2.loss.item())
out3 = c(input_ids=ids, labels=ids); print("next", out3.loss.item())
m.eval(); print("eval", m(input_ids=ids, labels=ids).loss.item())

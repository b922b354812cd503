"""`specjax export`: a model or a draft as a Hugging Face checkpoint directory.

Run: specjax export --config=configs/export.py --config.out=DIR [--config.what=draft]

what='model': `source` (a registry name, GGUF file or HF directory) as config.json +
model.safetensors (+ tokenizer.json when the source has a tokenizer); loads with
transformers' AutoModelForCausalLM and with specjax again.
what='draft': a draft directory written by `specjax distill` (`source`; "" = the draft shipped
for `target`) as a standalone Llama checkpoint: its shared tensors come from `target`, and a
reduced-vocabulary head becomes a full-vocabulary one (the target's embedding rows), so the
exported model drafts over the whole vocabulary (`head_ids.json` beside it lists the reduced
head's tokens).
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.what = "model"                    # 'model' or 'draft'
    c.source = "smollm2-135m-instruct"  # what='model': the model; what='draft': the draft directory ("" = shipped)
    c.target = "smollm2-135m-instruct"  # what='draft': the target the draft was made for
    c.dtype = "float32"                 # dtype of the written tensors: float32 | bfloat16 (what specjax loads)
    c.out = ""                          # the output directory (required; must not exist or be empty)
    return c

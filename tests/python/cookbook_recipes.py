"""tinker-cookbook's supervised and RL basics against a symbiosis-tinker server, as a user runs them
with the base model's name registered to a local tokenizer (no hub access). Run by
test_tinker_cookbook.py in an environment of its own (the cookbook pins its own transformers):

    python cookbook_recipes.py sl|rl BASE_URL MODEL_NAME TOKENIZER_DIR LOG_DIR

sl: supervised.train on the cookbook's own example conversations (sl_basic's recipe with its
    FromConversationFileBuilder instead of a hub dataset), batch 8, one epoch of 4 batches.
rl: the rl_loop recipe (sample groups with the renderer's stop sequences, importance_sampling,
    optim_step, checkpoints), its GSM8K rows replaced by four local sums and its answer check by a
    toy reward, two batches of 2 prompts x 4 samples.
Prints one JSON line per step of the recipe's own metrics file (metrics.jsonl) at the end.
"""
import asyncio
import os
import sys

import transformers

from tinker_cookbook import model_info, tokenizer_utils
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig


def supervised(base_url, model_name, log_dir):
    import tinker_cookbook

    conversations = os.path.join(os.path.dirname(tinker_cookbook.__file__), "example_data", "conversations.jsonl")
    renderer_name = model_info.get_recommended_renderer_name(model_name)
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model_name, renderer_name=renderer_name,
                                            max_length=200, batch_size=8,
                                            train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    config = sl_train.Config(
        log_path=log_dir, model_name=model_name, recipe_name="recipe_sl_basic", renderer_name=renderer_name,
        base_url=base_url, dataset_builder=FromConversationFileBuilder(common_config=common, file_path=conversations,
                                                                        test_size=8),
        learning_rate=1e-3, lr_schedule="linear", num_epochs=1, lora_rank=8, eval_every=2, save_every=2, max_steps=4)
    asyncio.run(sl_train.main(config))


def reinforcement(base_url, model_name, log_dir):
    """rl_loop as it is, its GSM8K rows replaced by local sums and its answer check by a toy reward
    (the share of vowels in a completion), so that a random model's groups differ and it trains."""
    import datasets

    from tinker_cookbook.recipes import rl_loop

    rows = {"question": [f"What is {a} + {b}?" for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]],
            "answer": [f"#### {a + b}" for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]}
    rl_loop.datasets.load_dataset = lambda *_, **__: datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)})
    rl_loop.get_reward = lambda content, answer: sum(c in "aeiou" for c in content) / max(len(content), 1)
    rl_loop.main(rl_loop.Config(base_url=base_url, log_path=log_dir, model_name=model_name, batch_size=2,
                                group_size=4, learning_rate=1e-3, lora_rank=8, save_every=1, max_tokens=24,
                                max_steps=2))


def main():
    recipe, base_url, model_name, tokenizer_dir, log_dir = sys.argv[1:6]
    tokenizer_utils.register_tokenizer(model_name, lambda: transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    if recipe == "sl":
        supervised(base_url, model_name, log_dir)
    elif recipe == "rl":
        reinforcement(base_url, model_name, log_dir)
    else:
        raise SystemExit(f"unknown recipe {recipe!r}: expected sl or rl")
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        for line in f:
            print(line.strip())


if __name__ == "__main__":
    main()

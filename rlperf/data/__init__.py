"""rlperf.data — prompt data for the RL loop and rule rewards.

* :mod:`~rlperf.data.jsonl` — ``--prompt-data`` jsonl files (``--input-key --label-key
  --metadata-key --apply-chat-template``); a bad line is named by its line number;
* :mod:`~rlperf.data.rewards` — built-in rule rewards (the embedded task; ``\\boxed{}`` math answers)
  and ``--custom-rm-path`` loading;
* :mod:`~rlperf.data.embedded` — the built-in task ``rlperf train`` runs with no arguments.
"""
from .embedded import EMBEDDED_DEFAULTS, EMBEDDED_TASK, EmbeddedTask, format_warmup
from .jsonl import DataError, PromptRecord, PromptDataset, load_prompt_data
from .rewards import boxed_answer, boxed_math_reward, exact_match_reward, load_python_path, reward_fn_for

__all__ = ["EMBEDDED_DEFAULTS", "EMBEDDED_TASK", "EmbeddedTask", "format_warmup", "DataError", "PromptRecord", "PromptDataset", "load_prompt_data",
           "boxed_answer", "boxed_math_reward", "exact_match_reward", "load_python_path", "reward_fn_for"]

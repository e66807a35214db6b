"""rlperf.data — prompt data for the RL loop and rule rewards.

* :mod:`~rlperf.data.jsonl` — ``--prompt-data`` jsonl files (``--input-key --label-key
  --metadata-key --apply-chat-template``); a bad line is named by its line number;
* :mod:`~rlperf.data.rewards` — built-in rule rewards (the embedded task; ``\\boxed{}`` math answers)
  and ``--custom-rm-path`` loading;
* :mod:`~rlperf.data.embedded` — the built-in task ``rlperf train`` runs with no arguments.
"""
from rlperf.lazy_exports import lazy_exports

_EXPORTS = {
    'EMBEDDED_DEFAULTS': '.embedded_defaults',
    'EMBEDDED_TASK': '.embedded',
    'EmbeddedTask': '.embedded',
    'format_warmup': '.embedded',
    'DataError': '.jsonl',
    'PromptRecord': '.jsonl',
    'PromptDataset': '.jsonl',
    'load_prompt_data': '.jsonl',
    'boxed_answer': '.rewards',
    'boxed_math_reward': '.rewards',
    'exact_match_reward': '.rewards',
    'load_python_path': '.rewards',
    'reward_fn_for': '.rewards',
}
"""Each exported name -> the submodule that defines it (imported when the name is first used)."""
__all__ = ["EMBEDDED_DEFAULTS", "EMBEDDED_TASK", "EmbeddedTask", "format_warmup", "DataError", "PromptRecord", "PromptDataset", "load_prompt_data",
           "boxed_answer", "boxed_math_reward", "exact_match_reward", "load_python_path", "reward_fn_for"]


__getattr__ = lazy_exports(__name__, _EXPORTS)

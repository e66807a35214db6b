"""The stand-in's attention backends: the choices of ``--attention-backend``, which a plugin may extend
before the parser is built (as SGLang's ``add_attention_backend_choices``)."""
ATTENTION_BACKEND_CHOICES = ["flashinfer", "triton", "fa3"]


def add_attention_backend_choices(choices):
    ATTENTION_BACKEND_CHOICES.extend(choices)

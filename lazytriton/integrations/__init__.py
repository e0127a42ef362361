"""Integrations of lazytriton with other libraries, each imported only when asked for.

``import lazytriton`` (and ``import lazytriton.integrations``) imports none of
them: a deployment that only calls the attention functions does not pay for,
or even need, transformers. Import the one you use, e.g.
``lazytriton.integrations.transformers``.
"""

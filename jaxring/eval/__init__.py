"""Long-context evaluations of a trained model on any plan: loss by position (`perplexity`) and pass-key
retrieval over context lengths × depths (`needle`), as `python -m jaxring.eval` (`cli`), JSON and PNG
(`plots`). The model comes from a jaxring checkpoint or a Hugging Face directory (`loading`) and runs one
sharded forward pass per batch (`scoring`, the model family's `token_scores`)."""

from jaxring.eval.loading import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]

"""Pipeline stages over MLX's distributed backend: a model's layers split over ranks (`split`), the link
between them (`link`), a micro-batched round (`pipeline`), and the stage model the integration and the
estimate follow (`model`)."""

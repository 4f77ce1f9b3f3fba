"""One module per model kind (``omni_models.registry.KINDS``): each has ``inspect(directory, name)`` and
``load(directory, name, options)``; the diffusers families also define their ``FAMILY`` and backend class."""

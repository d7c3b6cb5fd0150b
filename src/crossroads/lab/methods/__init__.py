"""Matrix methods; each module registers its own with :func:`crossroads.lab.matrix.register`."""

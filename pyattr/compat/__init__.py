"""Drop-ins for other libraries' users (``pyattr.compat.captum``)."""

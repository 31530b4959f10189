"""Maps the top-level kernels/, conf/ and recipes/ folders into the `deepinfer` package, so they are
importable (deepinfer.kernels) and found by Hydra (pkg://deepinfer.conf) after any install."""

from setuptools import find_packages, setup

ROOTS = {"deepinfer": "deepinfer", "deepinfer.kernels": "kernels", "deepinfer.conf": "conf", "deepinfer.recipes": "recipes"}

packages, package_dir = [], {}
for name, folder in ROOTS.items():
    package_dir[name] = folder
    packages.append(name)
    for sub in find_packages(folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
# Hydra config groups are folders of YAML without __init__.py: ship them as data of their root.
setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"deepinfer.conf": ["*.yaml", "**/*.yaml"], "deepinfer.recipes": ["*.yaml"], "": ["*.json"],
                  "deepinfer.assets": ["tiny-v41/*"]},
)

from jax_flash.bench.cli import main

main()

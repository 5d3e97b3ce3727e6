from autofit.cli import main

main()

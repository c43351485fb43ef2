"""HOST: `python -m jaxrl_agent <command>` (layer 9 of ARCHITECTURE.md): one module per
command, holding its configs and its job; `main.py` parses and dispatches.

    main.py        the parser, dotted overrides, `COMMANDS`
    demo.py sft.py train.py eval.py export.py rm_train.py bandit.py     the commands
    config_docs.py config_reference.py                                  --help and the reference
    compile_cache.py malloc_env.py                                      entry-point process set-up
"""
